"""Reward of the tiny CPU task (``reward.custom_reward_function.path=pkg://verl_traj.cpu.reward``).

Task: the prompt asks for digits. Score = fraction of the non-blank characters of the response
that are digits, in [0, 1]. A random-weight model emits digits a few percent of the time, so the
score starts near 0.05 and GRPO can raise it within tens of steps on CPU: a real, dense,
verifiable learning signal that needs no pretrained model.

``ground_truth`` (the digit named in the prompt) adds a small bonus for using that digit, so the
best policy also reads the prompt.
"""

from __future__ import annotations

from typing import Any


def digit_fraction(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c.isdigit() for c in chars) / len(chars)


def compute_score(data_source: str, solution_str: str, ground_truth: Any = None, extra_info: Any = None, **kwargs) -> float:
    score = digit_fraction(solution_str)
    if ground_truth is not None and str(ground_truth) != "":
        chars = [c for c in solution_str if not c.isspace()]
        if chars:
            score = 0.8 * score + 0.2 * (sum(c == str(ground_truth) for c in chars) / len(chars))
        else:
            score = 0.0
    return float(score)
