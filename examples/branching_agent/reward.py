"""The session's outcome for verl's reward function: 1.0 when its transcript (the first branch) guessed right. verl_traj
credits each leaf by its own outcome (``leaf_rewards``); this score is what verl logs as the step's reward."""

from branch_loop import CORRECT


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return 1.0 if CORRECT in solution_str else 0.0
