"""The SWE-bench per-step lengths in ``shared/data/swebench_steps.jsonl`` (beside the checkout, or the
file named by ``VERL_TRAJ_SWEBENCH``): one reader for the benchmarks and the tests.

Each line: ``{"id": "<repo>__<issue>", "exit_status": ..., "steps": [[prompt_tokens, response_tokens], ...]}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

DATA_FILE = Path(os.environ.get(
    "VERL_TRAJ_SWEBENCH", Path(__file__).resolve().parents[3] / "shared" / "data" / "swebench_steps.jsonl"
))


def load_trajectories(path: str | Path = DATA_FILE) -> list[dict]:
    """The raw trajectories, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_step_rows(path: str | Path = DATA_FILE) -> dict[str, np.ndarray]:
    """One row per step, ``[B]`` arrays: ``uid`` (GRPO group = consecutive trajectories of the same
    repository, the id prefix before ``__``), ``traj_id``, ``step_index``, ``prompt_tokens``,
    ``response_tokens``."""
    trajs = load_trajectories(path)
    repos = [t["id"].split("__")[0] for t in trajs]
    group = np.cumsum([i == 0 or r != repos[i - 1] for i, r in enumerate(repos)]) - 1
    lengths = np.asarray([len(t["steps"]) for t in trajs])
    steps = np.concatenate([np.asarray(t["steps"], dtype=np.int64).reshape(-1, 2) for t in trajs])
    per_traj = np.repeat(np.arange(len(trajs)), lengths)
    uid = np.asarray([f"{repos[i]}#{group[i]}" for i in range(len(trajs))], dtype=object)[per_traj]
    return dict(
        uid=uid,
        traj_id=np.asarray([t["id"] for t in trajs], dtype=object)[per_traj],
        step_index=np.arange(len(per_traj)) - np.repeat(np.cumsum(lengths) - lengths, lengths),
        prompt_tokens=steps[:, 0],
        response_tokens=steps[:, 1],
    )
