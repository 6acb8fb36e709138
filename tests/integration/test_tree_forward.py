"""One micro-batch forwarded as a prefix tree (``verl_traj.integration.tree.tree_forward``) equals the forward without
it.

* the tree-aware attention: a tree call equals each row's causal attention; a tree reaching the plain kernel raises;
* a tiny Qwen2 on the flash-attention path (``cpu_varlen``): tree logits gathered to rows equal the packed rows';
* verl's real FSDP2 engine worker on CPU (gloo, fp32, remove-padding, ``cpu_varlen``), rows sharing prefixes (GRPO
  groups behind one prompt, a duplicate row, step rows whose context is another row's prefix, a retokenised step)
  planned by the trainer's own code (``traj.prefix_tree``: the plan's micro-batches, their trees' facts built on the
  driver): the log-prob pass (``infer_batch``) gives the same per-row log-probs and entropy, and one training
  forward + backward (verl's PPO loss with an entropy term) the same gradient, with and without the tree, the trees
  built on the device from the plan's facts in each pass.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from verl_traj.core.kernels import tree_kernel
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import TREE_SEGMENT, TREE_SIZE_KEY
from verl_traj.core.trees.prefix_tree import build_prefix_tree, gather_flat
from verl_traj.core.kernels.tree_attention import TreeAttentionError, per_row_causal_attention, refuse_tree_in_plain_attention
from verl_traj.core.trees.tree_facts import micro_batch_tree_facts
from verl_traj.cpu.attention import CPU_VARLEN, varlen_attention
from verl_traj.integration.tree import tree_forward as tree_forward_module
from verl_traj.core.kernels.tree_kernel import TREE_KWARG, TreeAttentionInput, tree_aware_attention
from verl_traj.core.kernels.tree_pass import TreeForwardLog
from verl_traj.testing.engine import free_port


def _rows(g: torch.Generator, vocab: int = 64) -> list[torch.Tensor]:
    """Three rows behind one 9-token prompt, one continuing the first (a prefix of it), and one sharing nothing."""
    p = torch.randint(0, vocab, (9,), generator=g)
    rows = [torch.cat([p, torch.randint(0, vocab, (n,), generator=g)]) for n in (3, 5, 2)]
    return rows + [torch.cat([rows[0], torch.randint(0, vocab, (4,), generator=g)]), torch.randint(0, vocab, (6,), generator=g)]


def test_tree_call_equals_per_row_attention_and_a_tree_in_the_plain_kernel_raises():
    g = torch.Generator().manual_seed(0)
    tree = build_prefix_tree(_rows(g))
    n = tree.num_tree_tokens
    q = torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    attention = tree_aware_attention(varlen_attention)
    assert tree_aware_attention(attention) is attention  # installing twice wraps once
    got = attention(q, k, v, None, n, is_causal=True, position_ids=tree.position_ids[None],
                    **{TREE_KWARG: TreeAttentionInput(tree.subtree_end)})
    idx = [tree.row_index[a:b] for a, b in zip(tree.row_offsets[:-1].tolist(), tree.row_offsets[1:].tolist())]
    ref = per_row_causal_attention(*([x[0, i] for i in idx] for x in (q, k, v)))
    torch.testing.assert_close(gather_flat(tree, got[0]), torch.cat(ref), rtol=1e-12, atol=1e-12)
    with pytest.raises(TreeAttentionError, match="prefix-tree batch reached the plain attention"):
        attention(q, k, v, None, n, is_causal=True, position_ids=tree.position_ids[None])
    plain = torch.cat([torch.arange(5), torch.arange(n - 5)])[None]  # packed rows pass through unchanged
    torch.testing.assert_close(attention(q, k, v, None, n, is_causal=True, position_ids=plain),
                               varlen_attention(q, k, v, None, n, is_causal=True, position_ids=plain))
    with pytest.raises(TreeAttentionError, match="dropout"):
        attention(q, k, v, None, n, is_causal=True, dropout=0.1, **{TREE_KWARG: TreeAttentionInput(tree.subtree_end)})


def test_a_model_on_the_flash_path_forwards_a_tree_exactly():
    """Tiny Qwen2 with ``cpu_varlen``: the tree's logits gathered to rows equal the packed rows' logits; without the
    tree keyword the same tree tokens raise in the attention instead of being read as separate sequences."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.integrations import flash_attention

    from verl_traj.cpu.plugin import register

    if not register():
        pytest.skip("the CPU platform is not active in this process (an accelerator is present)")
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = CPU_VARLEN
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    rows = _rows(torch.Generator().manual_seed(1))
    tree = build_prefix_tree(rows)
    with mock.patch.object(flash_attention, "_flash_attention_forward", tree_aware_attention(varlen_attention)), \
            torch.no_grad():
        got = model(input_ids=tree.input_ids[None], position_ids=tree.position_ids[None], use_cache=False,
                    **{TREE_KWARG: TreeAttentionInput(tree.subtree_end)}).logits[0]
        checks = []
        with mock.patch.object(tree_kernel, "refuse_tree_in_plain_attention",
                               lambda *a, **k: checks.append(refuse_tree_in_plain_attention(*a, **k))):
            ref = model(input_ids=torch.cat(rows)[None], use_cache=False,
                        position_ids=torch.cat([torch.arange(len(r)) for r in rows])[None]).logits[0]
        assert len(checks) == 1  # one check (one device sync on a GPU) a forward, not one a layer
        torch.testing.assert_close(gather_flat(tree, got), ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(TreeAttentionError, match="prefix-tree batch reached the plain attention"):
            model(input_ids=tree.input_ids[None], position_ids=tree.position_ids[None], use_cache=False)


def _micro_batch(rows: list, **settings):
    """A remove-padding micro-batch of ``rows`` (nested ids, per-row ``arange`` position ids) with ``settings`` and
    its tree's facts as the plan ships them (one micro-batch: :func:`micro_batch_tree_facts` with one part)."""
    from verl.utils import tensordict_utils as tu

    facts = micro_batch_tree_facts(rows, np.zeros(len(rows), dtype=np.int64))
    nested = {"input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
              "position_ids": torch.nested.as_nested_tensor([torch.arange(len(r)) for r in rows], layout=torch.jagged),
              TREE_SEGMENT: torch.from_numpy(facts.segment)}
    return tu.get_tensordict(nested, {"use_remove_padding": True, "temperature": 1.0,
                                      TREE_SIZE_KEY: int(facts.size[0]), **settings})


def _settled(tree, checks: dict) -> None:
    """The pass's one read of a micro-batch's device checks (raises on a mismatch)."""
    log = TreeForwardLog()
    log.add(tree, tree.num_tree_tokens, checks)
    log.settle()


def _fsdp_engine(**attributes):
    """An FSDP engine instance (its seam finds it by class) with only ``attributes`` set."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = object.__new__(FSDPEngineWithLMHead)
    engine.__dict__.update(attributes)
    return engine


def test_the_tree_from_the_plans_facts_is_the_rows_tree_and_what_it_does_not_carry_is_refused():
    from types import SimpleNamespace

    from verl_traj.integration.engines import FSDP

    check, tree_batch = tree_forward_module._check_micro_batch, tree_forward_module._tree_batch
    rows = _rows(torch.Generator().manual_seed(2))
    engine = _fsdp_engine(use_ulysses_sp=False, module=SimpleNamespace(
        config=SimpleNamespace(_attn_implementation="flash_attention_2")))
    check(engine, FSDP, _micro_batch(rows))
    tree, ref = tree_forward_module.micro_batch_tree(_micro_batch(rows)), build_prefix_tree(rows)
    for name in ("input_ids", "position_ids", "subtree_end", "row_index"):
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name
    _settled(tree, tree.checks)
    for missing in (TREE_SEGMENT, TREE_SIZE_KEY):
        bare = _micro_batch(rows)
        bare.pop(missing) if missing == TREE_SEGMENT else bare.set_non_tensor(missing, None)
        with pytest.raises(TrajInputError, match=missing) as raised:
            tree_forward_module.micro_batch_tree(bare)
        assert raised.value.field == missing
    for settings, match in (({"use_remove_padding": False}, "use_remove_padding"),
                            ({"use_fused_kernels": True}, "use_fused_kernels"),
                            ({"distillation_use_topk": True}, "distillation_use_topk")):
        with pytest.raises(TreeAttentionError, match=match):
            check(engine, FSDP, _micro_batch(rows, **settings))
    check(_fsdp_engine(use_ulysses_sp=True, module=engine.module), FSDP, _micro_batch(rows))  # Ulysses is served
    with pytest.raises(TreeAttentionError, match="'sdpa', not the flash-attention path"):
        check(_fsdp_engine(use_ulysses_sp=False, module=SimpleNamespace(
            config=SimpleNamespace(_attn_implementation="sdpa"))), FSDP, _micro_batch(rows))
    with pytest.raises(TreeAttentionError, match="no engine seam serves with trees"):  # issue 54, item 5
        check(SimpleNamespace(use_ulysses_sp=False, module=engine.module), None, _micro_batch(rows))
    shifted = _micro_batch(rows)
    shifted["position_ids"] = torch.nested.as_nested_tensor([torch.arange(len(r)) + 1 for r in rows], layout=torch.jagged)
    moved = tree_forward_module.micro_batch_tree(shifted)
    with pytest.raises(TrajInputError, match="not 0..L-1") as raised:
        _settled(moved, moved.checks)
    assert raised.value.field == "position_ids"
    with_temperature = _micro_batch(rows)
    with_temperature["temperature"] = torch.full((len(rows),), 0.7)
    batch, checks = tree_batch(with_temperature, tree)
    assert batch["temperature"].tolist() == pytest.approx([0.7])
    _settled(tree, checks)
    with_temperature["temperature"] = torch.linspace(0.5, 1.0, len(rows))
    with pytest.raises(TrajInputError, match="one temperature") as raised:
        _settled(tree, tree_batch(with_temperature, tree)[1])
    assert raised.value.field == "temperature"


# ---------------------------------------------------------------------------------------------------------------
# verl's real engine worker
# ---------------------------------------------------------------------------------------------------------------
def _shared_prefix_rows(vocab: int, seed: int = 0) -> list[tuple[list, list, list]]:
    """(prompt, response, response mask) per row: two GRPO groups of 3 behind one prompt (in group 0 two responses
    share their first 4 tokens, one row is duplicated), a 3-step trajectory (each step's context the previous
    step's row plus an observation), step 3 once more behind a retokenised boundary (its context differs in step
    2's last response token: a branch), and a row sharing nothing."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    rows = []
    for plen in (24, 17):
        prompt, first = toks(plen), toks(12)
        for resp in (first, first[:4] + toks(9), toks(15)):
            rows.append((prompt, resp, [1] * len(resp)))
    rows.append(rows[0])
    q, a1, o1, a2, o2, a3 = toks(14), toks(6), toks(5), toks(7), toks(4), toks(8)
    rows.append((q, a1 + o1, [1] * 6 + [0] * 5))
    rows.append((q + a1 + o1, a2 + o2, [1] * 7 + [0] * 4))
    rows.append((q + a1 + o1 + a2 + o2, a3, [1] * 8))
    rows.append((q + a1 + o1 + a2[:-1] + toks(1) + o2, a3, [1] * 8))  # retokenised boundary
    rows.append((toks(11), toks(9), [1] * 9))
    return rows + [rows[2]] * (len(rows) % 2)  # an even row count (dp=2)


def _batch(rows: list):
    """verl's left/right-padded rollout layout of ``rows`` (a ``DataProto``)."""
    from verl_traj.testing import as_dataproto

    P, R, B = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows), len(rows)
    ids, attn, mask = torch.zeros(B, P + R, dtype=torch.long), torch.zeros(B, P + R, dtype=torch.long), torch.zeros(B, R)
    for i, (p, r, m) in enumerate(rows):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        attn[i, P - len(p):P + len(r)] = 1
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    g = torch.Generator().manual_seed(7)
    tensors = {"input_ids": ids, "prompts": ids[:, :P].clone(), "responses": ids[:, P:].clone(),
               "attention_mask": attn, "position_ids": torch.clamp(torch.cumsum(attn, -1) - 1, min=0),
               "response_mask": mask.long(), "old_log_probs": torch.zeros(B, R),
               "advantages": (torch.randn(B, 1, generator=g) * mask).contiguous()}
    uid = [",".join(map(str, p[:8])) for p, _, _ in rows]  # a group: the rows behind one prompt (one trajectory's too)
    return as_dataproto(tensors, {"uid": np.array(uid, dtype=object)})


def _planned(batch, cap: int, world: int, **traj):
    """``batch`` planned in place as the trainer plans it with ``traj.prefix_tree`` (one mini-batch; micro-batches
    under ``cap`` tree tokens; each one's tree facts attached; ``traj``: further ``traj:`` settings)."""
    from verl_traj.testing.engine import plan_for_update

    plan_for_update(batch, _config(cap), world, prefix_tree=True, **traj)
    return batch


@contextlib.contextmanager
def _trees(engine):
    """What a verl_traj worker does in a marked pass: the plan's micro-batches, each forwarded as its tree."""
    from verl_traj.integration.patches.scoped import micro_batch_patches, patched
    from verl_traj.integration.workers.planned_update import PlannedUpdate
    from verl_traj.integration.engines import engine_of
    from verl_traj.integration.tree.tree_forward import tree_forward

    with patched(micro_batch_patches(PlannedUpdate(seed=0, fields=()).prepare_micro_batches)), \
            tree_forward(engine, engine_of(engine)) as log:
        yield log


def _rank_data(batch, rank: int, world: int, tree: bool, **extra):
    from verl.utils import tensordict_utils as tu

    from verl_traj.testing.engine import rank_tensordict

    td = rank_tensordict(batch, rank, world, len(batch), extra={"prefix_tree": tree})
    tu.assign_non_tensor(td, calculate_entropy=True, **extra)
    return td


def _infer(worker, batch, rank, world, tree):
    """Per-row log-probs and entropy of the log-prob pass (verl's ``compute_log_prob`` settings)."""
    out = worker.infer_batch(_rank_data(batch, rank, world, tree, compute_loss=False))
    return out["log_probs"], out["entropy"]


def _grad(worker, batch, rank, world, tree) -> torch.Tensor:
    """The flattened gradient of one training forward + backward of verl's PPO loss (entropy term on)."""
    from torch.distributed.tensor import DTensor

    from verl.utils import tensordict_utils as tu

    engine, cfg = worker.engine, worker.engine_config
    data = _rank_data(batch, rank, world, tree)
    tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=cfg.use_dynamic_bsz,
                         max_token_len_per_gpu=cfg.max_token_len_per_gpu, use_fused_kernels=False,
                         micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu)  # what train_batch adds
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, worker.loss_fn, forward_only=False)
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in engine.module.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads]).clone()
        engine.optimizer_zero_grad()
    return flat


def _diffs(ref: torch.Tensor, got: torch.Tensor, keep: torch.Tensor) -> dict:
    """Max abs and max relative difference over the positions ``keep`` of two nested per-row outputs."""
    a, b = ref.values()[keep], got.values()[keep]
    err = (a - b).abs()
    return {"max_abs": float(err.max()), "max_rel": float((err / a.abs().clamp(min=1e-6)).max()),
            "positions": int(keep.sum())}


def _not_last(nested: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: every row token but each row's last (whose rolled label crosses into the next row)."""
    keep = torch.ones(int(nested.offsets()[-1]), dtype=torch.bool)
    keep[nested.offsets()[1:] - 1] = False
    return keep


def _compare(worker, batch, rank, world) -> dict:
    from verl.workers.utils.padding import no_padding_2_padding

    lp, ent = _infer(worker, batch, rank, world, tree=False)
    per = len(batch) // world
    td = _rank_data(batch, rank, world, False)
    batch.batch["old_log_probs"][rank * per:(rank + 1) * per] = no_padding_2_padding(lp, td) * td["response_mask"]
    g_ref = _grad(worker, batch, rank, world, tree=False)
    with _trees(worker.engine) as log:
        tlp, tent = _infer(worker, batch, rank, world, tree=True)
        with mock.patch.object(tree_kernel, "tree_attention", wraps=tree_kernel.tree_attention) as spy:
            g_tree = _grad(worker, batch, rank, world, tree=True)
    resp = no_padding_2_padding(lp, td) - no_padding_2_padding(tlp, td)
    return {"log_probs": _diffs(lp, tlp, _not_last(lp)), "entropy": _diffs(ent, tent, torch.ones_like(_not_last(ent))),
            "response_log_probs_max_abs": float((resp * td["response_mask"]).abs().max()),
            "grad_rel": float((g_tree - g_ref).norm() / g_ref.norm()), "grad_max_abs": float((g_tree - g_ref).abs().max()),
            "grad_norm": float(g_ref.norm()), "tree_tokens": log.tree_tokens, "row_tokens": log.row_tokens,
            "rows": log.rows, "row_micro_batches": log.row_micro_batches, "branch_copies": log.branch_copies, "forwarded_tokens": log.forwarded_tokens,
            "train_attention_calls": spy.call_count, "checkpointing": worker.engine.module.is_gradient_checkpointing,
            "restored": "prepare_model_inputs" not in vars(worker.engine)}


def _padded(worker, batch, rank, world) -> dict:
    """verl's static tail padding (``pad_to_length``, bucket 64) on: the log-prob pass with and without the tree."""
    engine = worker.engine
    engine.pad_to_length, engine.pad_to_length_bucket = True, 64
    try:
        lp, ent = _infer(worker, batch, rank, world, tree=False)
        with _trees(engine) as log:
            tlp, tent = _infer(worker, batch, rank, world, tree=True)
    finally:
        engine.pad_to_length = False
    return {"tree_tokens": log.tree_tokens, "forwarded_tokens": log.forwarded_tokens,"log_probs": _diffs(lp, tlp, _not_last(lp)), "entropy": _diffs(ent, tent, torch.ones_like(_not_last(ent)))}


@contextlib.contextmanager
def _attention_set_to(config, impl: str):
    """``config._attn_implementation = impl`` within (a property: ``mock.patch`` cannot restore it)."""
    before = config._attn_implementation
    config._attn_implementation = impl
    try:
        yield
    finally:
        config._attn_implementation = before


def _refusals(worker, batch, rank, world) -> dict:
    """What a tree micro-batch meets on a wrong path: the model on sdpa (refused before the forward), and the
    kernel without the tree-aware wrapper (the tree never reached the tree attention: refused after it)."""
    from verl.models.transformers import monkey_patch

    errors, config = {}, worker.engine.module.config
    with _trees(worker.engine):
        for name, ctx in (("sdpa", _attention_set_to(config, "sdpa")),
                          ("plain_kernel", mock.patch.object(monkey_patch, "_flash_attention_forward", varlen_attention))):
            with ctx:
                try:
                    _infer(worker, batch, rank, world, tree=True)
                    errors[name] = None
                except TreeAttentionError as e:
                    errors[name] = str(e)
    return errors


def _config(cap: int, extra=()):
    from verl_traj.testing.engine import cpu_config

    return cpu_config(["actor_rollout_ref.model.use_remove_padding=true",
                       f"actor_rollout_ref.model.override_config.attn_implementation={CPU_VARLEN}",
                       "actor_rollout_ref.actor.entropy_coeff=0.1", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={cap}", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", *extra])


def _proc(rank: int, world: int, port: int, home: str, cap: int, out_path: str, extra: tuple, more: bool,
          traj: tuple) -> None:
    import torch.distributed as dist

    from verl_traj.testing.engine import actor_worker, init_rank

    init_rank(rank, world, port, home)
    try:
        worker = actor_worker(_config(cap, extra), planned=False)
        batch = _planned(_batch(_shared_prefix_rows(int(worker.model_config.hf_config.vocab_size))), cap, world,
                         **dict(traj))
        res = _compare(worker, batch, rank, world)
        if more:
            res.update(padded=_padded(worker, batch, rank, world), refused=_refusals(worker, batch, rank, world))
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _run(home, world: int, cap: int, tmp_path, extra=(), more=False, traj=()) -> list[dict]:
    out = str(tmp_path / f"tree_w{world}_{cap}.json")
    mp.spawn(_proc, args=(world, free_port(), str(home), cap, out, tuple(extra), more, tuple(traj)), nprocs=world,
             join=True)
    res = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            res.append(json.load(f))
    return res


def _assert_exact(res: dict) -> None:
    assert res["restored"] and all(n <= t for n, t in zip(res["tree_tokens"], res["row_tokens"])), res
    assert res["log_probs"]["max_rel"] < 1e-5 and res["entropy"]["max_rel"] < 1e-5, res
    assert res["response_log_probs_max_abs"] < 1e-5 and res["grad_rel"] < 1e-5, res


@pytest.mark.dist
def test_real_engine_tree_forward_equals_rows_dp1(tiny_home, tmp_path):
    """One micro-batch of 12 rows (408 row tokens -> 195 tree tokens, 5 branch copies): log-probs, entropy and the
    gradient equal the forward without the tree; also with verl's static tail padding; wrong paths are refused."""
    (res,) = _run(tiny_home.parent, 1, 4096, tmp_path, more=True)
    print(json.dumps(res))
    _assert_exact(res)
    assert res["rows"] == [len(_shared_prefix_rows(64))] * 2 and min(res["branch_copies"]) > 0, res
    assert res["tree_tokens"][0] < res["row_tokens"][0] and res["train_attention_calls"] == 2, res  # 2 layers
    assert res["padded"]["forwarded_tokens"][0] % 64 == 0 < res["padded"]["forwarded_tokens"][0] - res["tree_tokens"][0]
    assert res["padded"]["log_probs"]["max_rel"] < 1e-5 and res["padded"]["entropy"]["max_rel"] < 1e-5, res
    assert "not the flash-attention path" in res["refused"]["sdpa"], res
    assert "never reached the tree attention" in res["refused"]["plain_kernel"], res


@pytest.mark.dist
def test_real_engine_tree_forward_equals_rows_dp2_capped_checkpointed(tiny_home, tmp_path):
    """dp=2, a token cap (60 tree tokens) under which the plan cuts each rank's rows into several micro-batches (one
    tree each), gradient checkpointing on (the backward recomputes every layer: the tree rides along as the model
    keyword)."""
    ranks = _run(tiny_home.parent, 2, 60, tmp_path,
                 extra=["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    print(json.dumps(ranks))
    for res in ranks:
        _assert_exact(res)
        assert len(res["rows"]) > 2 and res["checkpointing"], res  # several tree micro-batches per pass
        # each training micro-batch: 2 layers forward + 2 recomputed in the backward, all through the tree attention
        assert res["train_attention_calls"] == 4 * len(res["rows"]) // 2, res
    assert sum(sum(r["tree_tokens"]) for r in ranks) < sum(sum(r["row_tokens"]) for r in ranks)
    assert ranks[0]["grad_rel"] == pytest.approx(ranks[1]["grad_rel"], rel=1e-6)  # one gradient, all-reduced


@pytest.mark.dist
def test_real_engine_a_mix_of_tree_and_row_micro_batches_equals_rows(tiny_home, tmp_path):
    """Issue 55: the cost model decides per micro-batch. At ``traj.tree_token_cost=1`` (a tree token as dear as a row
    token) a micro-batch that shares nothing runs as rows, in the same passes as the tree micro-batches beside it
    (rank 0: one of each; a micro-batch whose rows would pass the 60-token cap stays a tree); log-probs, entropy and
    the all-reduced gradient still equal the rows-only forward."""
    ranks = _run(tiny_home.parent, 2, 60, tmp_path, traj=(("tree_token_cost", 1.0),))
    print(json.dumps(ranks))
    for res in ranks:
        _assert_exact(res)
    assert ranks[0]["row_micro_batches"] == 2 and len(ranks[0]["rows"]) == 2, ranks[0]  # log-prob and training pass
    assert ranks[1]["row_micro_batches"] == 0 and len(ranks[1]["rows"]) == 4, ranks[1]


@pytest.mark.dist
@pytest.mark.parametrize("extra", [
    ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"],
    ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
], ids=["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "gspo"])
def test_real_engine_tree_forward_equals_rows_in_every_loss_mode(tiny_home, tmp_path, extra):
    """verl's other loss aggregations and GSPO's sequence ratio: the loss reads only per-row outputs, which the tree
    gives exactly, so the gradient is the row forward's in each (dp=1, one tree micro-batch)."""
    (res,) = _run(tiny_home.parent, 1, 4096, tmp_path, extra=extra)
    _assert_exact(res)
