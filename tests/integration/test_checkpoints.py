"""A crash in the middle of a save never corrupts the resume: the newest COMPLETE checkpoint is picked."""

import os

from verl_traj.integration.trainers.checkpoints import COMPLETE_MARKER, TRACKER, latest_complete_step, mark_complete, repair_tracker


def _save(root, step, complete=True):
    d = root / f"global_step_{step}"
    (d / "actor").mkdir(parents=True)
    (d / "data.pt").write_bytes(b"x")
    if complete:
        mark_complete(str(root), step)


def test_partial_save_is_never_latest(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4, complete=False)  # killed after verl wrote its folder, before the marker
    (tmp_path / TRACKER).write_text("4")  # ... or even after verl's tracker
    assert latest_complete_step(str(tmp_path)) == 2
    assert repair_tracker(str(tmp_path)) == 2 and (tmp_path / TRACKER).read_text() == "2"


def test_truncated_tracker_is_repaired(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 3)
    (tmp_path / TRACKER).write_text("")  # killed while verl rewrote it: verl's resume would fail on int(b"")
    assert repair_tracker(str(tmp_path)) == 3 and (tmp_path / TRACKER).read_text() == "3"


def test_no_complete_checkpoint_means_from_scratch(tmp_path):
    (tmp_path / "global_step_1" / "actor").mkdir(parents=True)  # killed before data.pt
    (tmp_path / TRACKER).write_text("1")
    assert repair_tracker(str(tmp_path)) is None and not (tmp_path / TRACKER).exists()
    assert repair_tracker(str(tmp_path / "missing")) is None


def test_checkpoints_saved_without_markers_still_resume(tmp_path):
    for step in (5, 10):
        (tmp_path / f"global_step_{step}").mkdir()
        (tmp_path / f"global_step_{step}" / "data.pt").write_bytes(b"x")
    assert latest_complete_step(str(tmp_path)) == 10
    assert not any(COMPLETE_MARKER in f for f in os.listdir(tmp_path / "global_step_10"))
