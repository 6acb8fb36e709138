"""The outcome reward of the digit-guessing game (``reward.custom_reward_function.path``): 1.0 when the environment
said the trajectory's last guess was right. verl calls it once per trajectory, on its whole decoded response."""

from guess_loop import CORRECT


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return 1.0 if CORRECT in solution_str else 0.0
