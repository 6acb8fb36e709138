"""scripts/bench_stepwise.py: a smoke run on the first trajectories of the shared data (JSON structure, tree <= linear
merge <= one row per call), and its synthetic token ids on small cases: the distinct prefixes it counts by
construction are the brute-force distinct prefixes, and equal ``tree_token_count``'s tree tokens - branch copies."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from verl_traj.core.trees.prefix_tree import tree_token_count
from verl_traj.stepwise.prefix_merge import merge_trajectory_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_stepwise.py")
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "swebench_steps.jsonl")  # ../shared beside the repo

_spec = importlib.util.spec_from_file_location("bench_stepwise", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_stepwise", bench)  # dataclasses look their module up by name
_spec.loader.exec_module(bench)

SCENARIO_KEYS = {"scenario", "kind", "retokenise_prob", "tree_per", "trajectories", "boundaries", "broken_boundaries",
                 "rows_per_call", "tokens_per_call", "rows_linear", "tokens_linear", "trees", "tokens_tree",
                 "branch_copies", "distinct_prefixes", "tree_equals_distinct_prefixes", "broken_fraction",
                 "linear_over_tree", "per_call_over_tree", "per_call_over_linear", "seconds"}

# [prompt_tokens, response_tokens] per step: append-only, empty observations, and rewritten contexts (shorter than
# the previous context: the first prompt's start kept, the rest fresh), some keeping the whole first prompt
STEP_CASES = [
    [[5, 3], [10, 2], [14, 4], [20, 1]],
    [[4, 2], [6, 3], [9, 1], [10, 2]],
    [[6, 2], [5, 3], [9, 1], [4, 2], [6, 1], [12, 2]],
    [[4, 2], [4, 3], [2, 1], [9, 2], [3, 0], [4, 1]],
    [[3, 1]],
]


def distinct_prefixes(rows):
    """Brute force: the set of non-empty prefixes of the rows."""
    return len({tuple(r[:j].tolist()) for r in rows for j in range(1, r.numel() + 1)})


def merged_rows(s):
    rows, _ = merge_trajectory_steps(s.prompts, s.responses)
    return [torch.cat([row.prompt_ids, row.response_ids]) for row in rows]


@pytest.mark.parametrize("steps", STEP_CASES)
@pytest.mark.parametrize("vocab", [3, 5, 150000])
@pytest.mark.parametrize("retokenise_tokens", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_trajectory_distinct_prefixes_exact(steps, vocab, retokenise_tokens, seed):
    """Tiny vocabularies make every accidental repeat likely: the count by construction must still be exact, and the
    tree of the step rows equal the tree of linear merge's rows."""
    gen = torch.Generator().manual_seed(seed)
    s = bench.synthesise_steps(steps, gen, 0.5, vocab=vocab, retokenise_tokens=retokenise_tokens)
    assert [p.numel() for p in s.prompts] == [p for p, _ in steps]
    assert [r.numel() for r in s.responses] == [r for _, r in steps]
    n_tree, copies = tree_token_count(bench.step_rows(s))
    assert n_tree - copies == s.distinct_prefixes == distinct_prefixes(bench.step_rows(s))
    assert tree_token_count(merged_rows(s)) == (n_tree, copies)


@pytest.mark.parametrize("steps", STEP_CASES[:4])
@pytest.mark.parametrize("seed", range(4))
def test_group_distinct_prefixes_exact(steps, seed):
    """A GRPO group over an 8-token vocabulary (3 samples): samples branch right after the shared prompt, and a
    rewritten context that keeps (part of) the shared prompt branches off every sample's tokens there."""
    vocab, head_len = 8, 4
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (head_len,), generator=gen, dtype=torch.int32)
    firsts = torch.randperm(vocab, generator=gen)[:3].tolist()
    turns = [bench.grpo_steps(STEP_CASES[(k + seed) % 4], head_len) for k in range(2)] + [bench.grpo_steps(steps, head_len)]
    samples, distinct = bench.synthesise_group(turns, head, firsts, gen, 0.5, 2, vocab)
    rows = [r for s in samples for r in bench.step_rows(s)]
    assert all(torch.equal(s.prompts[0], head) for s in samples)
    n_tree, copies = tree_token_count(rows)
    assert n_tree - copies == distinct == distinct_prefixes(rows)
    assert tree_token_count([r for s in samples for r in merged_rows(s)]) == (n_tree, copies)


def test_retokenise_tokens_do_not_change_linear_merge():
    """The number of re-tokenised tokens changes the tree only, never the random stream or linear merge's rows."""
    steps = STEP_CASES[0]
    out = []
    for k in (1, 3):
        s = bench.synthesise_steps(steps, torch.Generator().manual_seed(1), 0.7, retokenise_tokens=k)
        out.append((s.breaks, [r.numel() for r in merged_rows(s)]))
    assert out[0] == out[1]


def test_tree_counts_refuses_a_wrong_limit():
    rows = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])]  # 4 distinct prefixes, 1 copy
    assert bench.tree_counts(rows, 4, "case") == (5, 1)
    with pytest.raises(AssertionError, match="case: tree tokens 5 - branch copies 1 != distinct prefixes 5"):
        bench.tree_counts(rows, 5, "case")


def test_no_free_token_is_refused():
    with pytest.raises(ValueError, match="no branch can diverge"):
        bench._new_child(0, {0, 1}, 2)


@pytest.mark.skipif(not os.path.exists(DATA), reason="shared benchmark data not present")
@pytest.mark.parametrize("extra", [[], ["--retokenise-prob", "0.3", "--planner", "model"]])
def test_bench_json(extra):
    out = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", *extra],
                         capture_output=True, text=True, check=True, timeout=300)
    res = json.loads(out.stdout)
    assert res["trajectories"] == 16
    assert res["loss_tokens_identical"] and res["loss_tokens_stepwise"] == res["loss_tokens_merged"] > 0
    assert res["rows_merged"] <= res["rows_stepwise"] and res["tokens_merged"] < res["tokens_stepwise"]
    if not extra:
        assert res["rows_merged"] == 16  # append-only conversations: one row per trajectory
    assert res["planned_update_workload_merged"] < res["planned_update_workload_stepwise"]

    tree = res["prefix_tree"]
    assert tree["tree_rows"] == "merged" and tree["swe_trajectories"] == 16 and tree["grpo_groups"] == 1
    scenarios = tree["scenarios"]
    assert [(s["kind"], s["retokenise_prob"]) for s in scenarios[:3]] == [("swe", 0.0), ("swe", 0.1), ("swe", 0.3)]
    grpo = [(s["retokenise_prob"], s["group_size"], s["shared_prompt_tokens"]) for s in scenarios[3:]]
    assert grpo == [(p, n, k) for p in (0.0, 0.1) for n in (8, 16) for k in (2048, 8192)]
    for s in scenarios:
        assert SCENARIO_KEYS <= set(s), s["scenario"]
        assert s["tree_equals_distinct_prefixes"] and s["tokens_tree"] - s["branch_copies"] == s["distinct_prefixes"]
        assert 0 < s["tokens_tree"] <= s["tokens_linear"] <= s["tokens_per_call"], s["scenario"]
        assert s["rows_linear"] <= s["rows_per_call"] and s["broken_boundaries"] <= s["boundaries"]
        assert (s["broken_boundaries"] == 0) == (s["retokenise_prob"] == 0)
    swe = scenarios[:3]
    assert swe[0]["tokens_tree"] == swe[0]["tokens_linear"] and swe[0]["branch_copies"] == 0  # one chain each
    if not extra:
        assert swe[0]["tokens_linear"] == res["tokens_merged"]
    assert swe[0]["tokens_linear"] < swe[1]["tokens_linear"] < swe[2]["tokens_linear"]  # breaks cost linear merge
    assert swe[2]["tokens_tree"] - swe[0]["tokens_tree"] < 0.01 * swe[0]["tokens_tree"]  # ...and hardly the tree
    for s in scenarios[3:7]:  # no breaks: the tree saves the shared prompt (n - 1) times per group, one copy a sample
        n, k = s["group_size"], s["shared_prompt_tokens"]
        assert s["tokens_linear"] - s["tokens_tree"] == (n - 1) * k - s["branch_copies"]
        assert s["branch_copies"] == n - 1
    assert set(tree["goal"]) == {"target_ratio", "break_prob", "all_trees_at_distinct_prefix_limit",
                                 "linear_over_tree", "met"}
    assert tree["goal"]["all_trees_at_distinct_prefix_limit"] is True
    assert tree["goal"]["linear_over_tree"] == swe[1]["linear_over_tree"]


def test_bench_table_quick():
    """The default table output runs (both tables and the goal line)."""
    if not os.path.exists(DATA):
        pytest.skip("shared benchmark data not present")
    out = subprocess.run([sys.executable, SCRIPT, "--quick", "--grpo-sizes", "4", "--grpo-prompt-tokens", "512"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert "training tokens" in out and "linear/tree" in out and "GRPO n=4, 0.5K prompt, 0% breaks" in out
    assert "goal (issue 29)" in out
