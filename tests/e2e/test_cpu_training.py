"""End-to-end: real verl GRPO training on CPU through ``python -m verl_traj.main_ppo --config-name cpu_tiny``.

The e2e test runs the whole stack (Ray, verl's trainer with verl_traj's mixin, FSDP2 on gloo, the CPU
rollout server behind verl's agent loop, weight sync after every update) and checks it did real work
(multi-turn tool agents: tests/e2e/test_stepwise_training.py and the calculator recipe). The first tests are fast unit checks of the CPU pieces (no Ray).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.e2e.runs import ONE_RANK_CONFIG, one_rank_ppo


GiB = 1024**3


# ---------------------------------------------------------------------------------------------
# fast checks (no Ray, no training)
# ---------------------------------------------------------------------------------------------
def test_plugin_registers_cpu_platform_without_accelerator():
    import verl  # noqa: F401  (loads the verl.plugins entry point)
    from verl.plugin.platform import get_platform
    from verl.utils.device import get_device_name, get_nccl_backend

    from verl_traj.cpu import plugin
    from verl_traj.cpu.detect import accelerator_present

    if accelerator_present():
        pytest.skip("an accelerator is present: the CPU platform must stay unregistered")
    assert plugin.register()  # idempotent: True where the CPU platform is active
    assert get_platform().device_name == "cpu" == get_device_name()
    assert get_nccl_backend() == "gloo"
    assert get_platform().current_device() == torch.device("cpu")
    assert plugin._gloo_only("cpu:gloo,cpu:gloo") == "gloo"
    assert plugin._gloo_only(None) == "gloo"
    assert plugin._gloo_only("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"

    from verl.workers.engine import EngineRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__ == "FSDPEngineWithLMHead"
    assert get_rollout_class("cpu", "async").__name__ == "CPUServerAdapter"
    assert get_rollout_replica_class("cpu").__name__ == "CPUReplica"


@pytest.mark.parametrize("how", ["cuda_available", "VERL_TRAJ_CPU=0"])
def test_plugin_stays_out_when_accelerator_present(how):
    """With an accelerator (simulated: torch.cuda.is_available() -> True) or VERL_TRAJ_CPU=0, nothing
    CPU-specific is registered or patched: GPU runs see stock verl (the rollout name 'cpu' is only
    a registry entry)."""
    import os
    import subprocess
    import sys

    code = """
import json, torch
if HOW == "cuda_available":
    torch.cuda.is_available = lambda: True
import verl
import verl.utils.distributed as d
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl_traj.cpu import plugin
from verl.workers.engine import EngineRegistry
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
print(json.dumps({
    "active": plugin.register(),
    "registered": "cpu" in PlatformRegistry.registered_names(),
    "patched": d.initialize_global_process_group.__module__ != "verl.utils.distributed",
    "cpu_engine": "cpu" in EngineRegistry._engines["language_model"]["fsdp2"],
    "rollout_entry": ("cpu", "async") in _ROLLOUT_REGISTRY,
}))
""".replace("HOW", repr(how))
    env = dict(os.environ)
    if how == "VERL_TRAJ_CPU=0":
        env["VERL_TRAJ_CPU"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"active": False, "registered": False, "patched": False, "cpu_engine": False,
                   "rollout_entry": True}, res


def test_sampler_top_k_top_p_and_logprobs():
    from verl_traj.cpu.decoding import filter_logits, sample_token

    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)[2:]).all()
    kept = ~torch.isinf(filter_logits(logits, top_k=-1, top_p=0.5))
    assert kept.tolist() == [True, False, False, False, False]  # p(token0) = 0.64 >= 0.5
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(2000):
        tok, logp = sample_token(logits, 1.0, 2, 1.0, g)
        counts[tok] += 1
        assert math.isclose(logp, float(torch.log_softmax(logits, -1)[tok]), rel_tol=1e-6)
    assert counts[2:].sum() == 0 and 0.6 < counts[0] / 2000 < 0.85  # e^1/(1+e^1) = 0.73
    tok, logp = sample_token(logits, 0.0, -1, 1.0, g)  # greedy
    assert tok == 0
    tok, logp = sample_token(logits, 0.5, -1, 1.0, g)  # log-prob of the temperature-scaled distribution
    assert math.isclose(logp, float(torch.log_softmax(logits / 0.5, -1)[tok]), rel_tol=1e-6)


def test_server_generation_matches_teacher_forcing(tiny_home):
    """KV-cache sampling log-probs == full-sequence forward log-probs on the same weights;
    stop tokens end generation; update_weights really swaps weights."""
    import asyncio

    from verl_traj.cpu.rollout import CPUGenerationServer

    server = CPUGenerationServer(
        config={"dtype": "float32", "prompt_length": 64, "response_length": 24, "seed": 0},
        model_config={"path": str(tiny_home / "model"), "override_config": {"attn_implementation": "sdpa"}},
    )
    prompt = [1, 10, 20, 30, 40]

    async def go():
        out = await server.generate(request_id="r", prompt_ids=prompt,
                                    sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True})
        ref = await server.compute_log_probs(prompt, out.token_ids)
        stop_tok = out.token_ids[0]
        out2 = await server.generate(request_id="s", prompt_ids=prompt, sampling_params={
            "temperature": 0, "logprobs": False, "stop_token_ids": [], "max_tokens": 5})
        first_greedy = out2.token_ids[0]
        out3 = await server.generate(request_id="t", prompt_ids=prompt, sampling_params={
            "temperature": 0, "stop_token_ids": [first_greedy], "max_tokens": 5})
        before = await server.get_weights_checksum()
        sd = {k: v + 0.01 for k, v in server.model.state_dict().items()}
        await server.update_weights(sd, global_steps=7)
        after = await server.get_weights_checksum()
        return out, ref, out2, out3, first_greedy, before, after, stop_tok

    out, ref, out2, out3, first_greedy, before, after, _ = asyncio.run(go())
    assert len(out.token_ids) == 24 or out.stop_reason == "completed"
    assert max(abs(a - b) for a, b in zip(out.log_probs, ref)) < 1e-4
    assert len(out2.token_ids) == 5 and out2.log_probs is None
    assert out3.token_ids == [first_greedy] and out3.stop_reason == "completed"
    assert after != before and server.global_steps == 7


def test_server_batched_generation_matches_teacher_forcing(tiny_home):
    """Concurrent requests of different prompt lengths are batched (left padding, one KV cache);
    every row's log-probs still equal a full forward of that row alone; per-row stops and limits."""
    import asyncio

    from verl_traj.cpu.rollout import CPUGenerationServer

    server = CPUGenerationServer(
        config={"dtype": "float32", "prompt_length": 64, "response_length": 20, "seed": 1, "max_num_seqs": 16},
        model_config={"path": str(tiny_home / "model")},
    )
    prompts = [[1, 5, 9], [1, 7, 7, 7, 7, 7, 7, 30], [1, 40, 41, 42, 43], [2], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]

    async def go():
        tasks = [server.generate(request_id=str(i), prompt_ids=p, sampling_params={
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 8 + i})
            for i, p in enumerate(prompts)]
        outs = await asyncio.gather(*tasks)
        refs = [await server.compute_log_probs(p, o.token_ids) for p, o in zip(prompts, outs)]
        return outs, refs

    outs, refs = asyncio.run(go())
    assert server.stats["batches"] < len(prompts)  # really batched
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert len(o.token_ids) == 8 + i or o.stop_reason == "completed"
        assert max(abs(a - b) for a, b in zip(o.log_probs, ref)) < 1e-4, (i, o.log_probs[:3], ref[:3])


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_cpu_training_end_to_end(shared_run, tiny_home):
    """The shared one-rank PPO run (``one_rank_ppo``) did real work: real gradients, the rollout server and the
    actor on the same weights, trained weights exported. (GRPO end to end: the calculator recipe, the step-wise
    runs and the two-rank runs.)"""
    steps = 2
    run = shared_run(one_rank_ppo("v1", steps), config_name=ONE_RANK_CONFIG)
    assert run.returncode == 0, run.tail()
    assert [m["step"] for m in run.metrics] == list(range(1, steps + 1)), run.tail()

    for m in run.metrics:
        # real gradients
        assert m["actor/grad_norm"] > 0 and math.isfinite(m["actor/grad_norm"])
        # rollout server and actor agree on the same weights (|p_rollout - p_actor| per token)
        assert m["training/rollout_probs_diff_valid"] == 1
        assert m["training/rollout_probs_diff_max"] < 1e-4, m["training/rollout_probs_diff_max"]
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999
        for key in ("critic/score/mean", "critic/advantages/max", "response_length/mean", "actor/pg_loss",
                    "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights", "timing_s/step"):
            assert key in m, key
        assert m["response_length/mean"] > 0

    # weights changed: the HF export of the trained actor differs from the initial random model
    from safetensors.torch import load_file

    ckpt = run.workdir / "ckpt" / "verl_traj_cpu" / ONE_RANK_CONFIG / f"global_step_{steps}" / "actor" / "huggingface"
    trained = load_file(str(next(ckpt.glob("*.safetensors"))))
    initial = load_file(str(tiny_home / "model" / "model.safetensors"))
    common = sorted(set(trained) & set(initial))
    assert common, (sorted(trained)[:5], sorted(initial)[:5])
    max_change = max(float((trained[k].float() - initial[k].float()).abs().max()) for k in common)
    assert max_change > 1e-5, max_change

    step_times = [m["timing_s/step"] for m in run.metrics]
    figures = {
        "wall_seconds": round(run.wall_seconds, 1),
        "step_seconds": [round(t, 2) for t in step_times],
        "peak_rss_gib_process_tree": round(run.peak_rss_bytes / GiB, 2),
        "rollout_probs_diff_max": max(m["training/rollout_probs_diff_max"] for m in run.metrics),
        "grad_norm": [round(m["actor/grad_norm"], 4) for m in run.metrics],
        "score_mean": [round(m["critic/score/mean"], 4) for m in run.metrics],
        "max_weight_change": max_change,
    }
    (run.workdir / "figures.json").write_text(json.dumps(figures, indent=1))
    print("\n[cpu e2e figures]", json.dumps(figures))
    assert run.peak_rss_bytes < 16 * GiB
