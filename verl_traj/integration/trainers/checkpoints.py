"""Checkpoints a crash cannot corrupt: a completion marker per checkpoint, an atomic tracker, and a resume
that only ever picks a complete checkpoint.

verl writes ``global_step_N/{actor,critic,data.pt}`` and then ``latest_checkpointed_iteration.txt`` (the
tracker) by truncating and rewriting it. A process killed in the middle of a save leaves a partial
``global_step_N``; one killed while the tracker is rewritten leaves it empty, and verl's resume then fails
on ``int(b"")``. So:

* after verl's save, ``global_step_N/verl_traj_complete`` is written (atomically: temp file + rename) and
  the tracker is rewritten atomically;
* before verl's resume, :func:`repair_tracker` points the tracker at the newest COMPLETE checkpoint (marker
  present; for a directory saved without markers, ``data.pt`` present), whatever the tracker said, or
  removes it when there is none (training then starts from scratch, as verl does without a tracker).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["CompleteCheckpoints", "COMPLETE_MARKER", "TRACKER", "latest_complete_step", "mark_complete", "repair_tracker"]

COMPLETE_MARKER = "verl_traj_complete"
STATE_FILE = "verl_traj_state.json"  # the driver's own state across steps (traj.stale_groups=correct's gate)
TRACKER = "latest_checkpointed_iteration.txt"  # verl's tracker file name
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_complete(root: str, step: int) -> None:
    """After verl saved ``global_step_{step}``: its completion marker, then the tracker, both atomically."""
    _atomic_write(os.path.join(root, f"global_step_{step}", COMPLETE_MARKER), str(step))
    _atomic_write(os.path.join(root, TRACKER), str(step))


def latest_complete_step(root: str) -> Optional[int]:
    """The newest ``global_step_N`` under ``root`` that finished saving, or None."""
    if not os.path.isdir(root):
        return None
    steps = {int(m.group(1)): os.path.join(root, name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))}
    marked = [s for s, d in steps.items() if os.path.isfile(os.path.join(d, COMPLETE_MARKER))]
    if marked:
        return max(marked)
    legacy = [s for s, d in steps.items() if os.path.isfile(os.path.join(d, "data.pt"))]  # saved without markers
    return max(legacy) if legacy else None


def repair_tracker(root: str) -> Optional[int]:
    """Point verl's tracker at the newest complete checkpoint (or remove it when there is none); returns it."""
    step = latest_complete_step(root)
    tracker = os.path.join(root, TRACKER)
    if step is None:
        if os.path.exists(tracker):
            os.remove(tracker)
        return None
    _atomic_write(tracker, str(step))
    return step


class CompleteCheckpoints:
    """Mixin for verl's trainers (v0 and v1: the same ``_save_checkpoint`` / ``_load_checkpoint`` contract and
    directory layout): mark each finished save complete; resume (``trainer.resume_mode=auto``) only from a
    complete checkpoint. Inactive with ``traj.enable=false`` (``self.traj_config``)."""

    def _checkpoint_root(self) -> str:
        root = self.config.trainer.default_local_dir
        return root if os.path.isabs(root) else os.path.join(os.getcwd(), root)

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if not self.traj_config.enable:
            return
        state = self._traj_checkpoint_state()
        if state:  # before the marker: a checkpoint is complete with its state or not at all
            _atomic_write(os.path.join(self._checkpoint_root(), f"global_step_{self.global_steps}", STATE_FILE),
                          json.dumps(state))
        if not self.config.actor_rollout_ref.actor.checkpoint.get("async_save", False):
            mark_complete(self._checkpoint_root(), self.global_steps)

    def _load_checkpoint(self):
        trainer = self.config.trainer
        if self.traj_config.enable and trainer.resume_mode == "auto" and trainer.get("default_hdfs_dir") is None:
            step = repair_tracker(self._checkpoint_root())
            logger.info("verl_traj: resuming from the newest complete checkpoint: %s", step)
        out = super()._load_checkpoint()
        if self.traj_config.enable and int(getattr(self, "global_steps", 0) or 0) > 0:
            folder = (trainer.resume_from_path if trainer.resume_mode == "resume_path"
                      else os.path.join(self._checkpoint_root(), f"global_step_{self.global_steps}"))
            path = os.path.join(folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder), STATE_FILE)
            if os.path.isfile(path):
                with open(path) as f:
                    self._restore_traj_checkpoint_state(json.load(f))
        return out

    def _traj_checkpoint_state(self) -> dict:
        """What verl_traj's driver keeps across steps beyond verl's own state (saved with each checkpoint)."""
        return {}

    def _restore_traj_checkpoint_state(self, state: dict) -> None:
        """Resume: take back :meth:`_traj_checkpoint_state`'s value."""
