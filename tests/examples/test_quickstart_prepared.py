"""The quick start's own lines: what the prepared model did before training (its evaluation's malformed tool calls,
counted, not logged)."""

import json

from verl_traj import quickstart


def test_the_summary_reports_the_prepared_models_malformed_calls(tmp_path):
    assert quickstart.prepared_summary(tmp_path) == ""  # nothing prepared: no line
    figures = {"greedy_accuracy": 0.765625, "sampled_accuracy": 0.296875, "greedy_malformed_calls": 0,
               "sampled_malformed_calls": 6, "sampled_malformed_call_share": 6 / 141}
    (tmp_path / "WARM_START.json").write_text(json.dumps(figures))
    line = quickstart.prepared_summary(tmp_path)
    assert line.startswith("- the prepared model before training") and "accuracy 0.77 greedy, 0.30 sampled" in line
    assert "malformed tool calls in that evaluation (counted, not logged as errors): 0 greedy, 6 sampled (4.3%" in line
    del figures["sampled_malformed_calls"]
    (tmp_path / "WARM_START.json").write_text(json.dumps(figures))  # a cache prepared before they were counted
    assert "were not counted (prepared by an older verl_traj: delete the cache)" in quickstart.prepared_summary(tmp_path)
