"""StepwiseToolAgentLoop on verl's real ToolAgentLoop machinery (offline tiny tokenizer, scripted LLM server)."""

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("tokenizers")

from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.tools.schemas import OpenAIFunctionToolSchema  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402

from verl_traj.integration.agent_loops.stepwise_agent_loop import StepwiseToolAgentLoop  # noqa: E402
from verl_traj.stepwise.expand import decode_step_records, expand_step_rows  # noqa: E402

CALL = '<tool_call>\n{"name": "digits", "arguments": {"n": 3}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from verl_traj.cpu.build_tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), 512, 0)


class _Out:
    def __init__(self, ids, lps):
        self.token_ids, self.log_probs = ids, lps
        self.num_preempted, self.extra_fields, self.routed_experts = None, {}, None


class ScriptedServer:
    """Answers with a tool call for the first ``n_calls`` turns, then a final answer; remembers prompts."""

    def __init__(self, tok, n_calls):
        self.tok, self.n_calls, self.seen = tok, n_calls, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        self.seen.append(list(prompt_ids))
        text = CALL if len(self.seen) <= self.n_calls else "777<|im_end|>"
        ids = self.tok.encode(text, add_special_tokens=False)
        k = len(self.seen)
        return _Out(ids, [-0.01 * k - 0.001 * i for i in range(len(ids))])


def _run(tokenizer, n_calls, response_length=512, loop_cls=StepwiseToolAgentLoop):
    from verl_traj.cpu.build_tiny import TOOL_SCHEMA
    from verl_traj.cpu.tools import DigitsTool

    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {
            "prompt_length": 1024, "response_length": response_length, "full_determinism": False,
            "multi_turn": {"max_user_turns": 8, "max_assistant_turns": 8, "max_parallel_calls": 1,
                           "max_tool_response_length": 64, "tool_response_truncate_side": "middle",
                           "format": "hermes"}}},
        "data": {"apply_chat_template_kwargs": {}},
    })
    tool = DigitsTool({"type": "native"}, OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA))
    server = ScriptedServer(tokenizer, n_calls)

    async def main():
        loop = loop_cls(
            trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer, processor=None,
            dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([tool]),
        )
        msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "write 7"}]
        return await loop.run({"temperature": 1.0}, raw_prompt=msgs)

    return asyncio.run(main()), server


@pytest.mark.parametrize("n_calls", [0, 2])
def test_records_each_llm_call_and_merge_restores_the_concatenated_row(tokenizer, n_calls):
    out, server = _run(tokenizer, n_calls)
    steps = decode_step_records(out.extra_fields["traj_steps"])
    assert len(steps) == n_calls + 1 == len(server.seen)
    # each record's prompt is exactly the context that call saw
    for rec, seen in zip(steps, server.seen):
        assert rec["prompt_ids"].tolist() == seen
        assert len(rec["response_logprobs"]) == len(rec["response_ids"])
    assert isinstance(out.extra_fields["traj_id"], str)
    # steps are stored delta-encoded: later steps only carry their new (observation) tokens
    enc = out.extra_fields["traj_steps"]["steps"]
    if n_calls:
        assert enc[1]["prompt_prefix_len"] == len(server.seen[0]) + len(steps[0]["response_ids"])

    # as verl's AgentLoopWorker would batch it (left-padded prompt, right-padded response)
    P, R = 1024, 512
    p = torch.tensor(out.prompt_ids)
    r = torch.tensor(out.response_ids)
    m = torch.tensor(out.response_mask)
    lp = torch.tensor(out.response_logprobs)
    tensors = {
        "prompts": torch.nn.functional.pad(p, (P - p.numel(), 0)).unsqueeze(0),
        "responses": torch.nn.functional.pad(r, (0, R - r.numel())).unsqueeze(0),
        "response_mask": torch.nn.functional.pad(m, (0, R - m.numel())).unsqueeze(0),
        "rollout_log_probs": torch.nn.functional.pad(lp, (0, R - lp.numel())).unsqueeze(0),
        "attention_mask": torch.cat([torch.arange(P) >= P - p.numel(), torch.arange(R) < r.numel()]).long().unsqueeze(0),
        "rm_scores": torch.zeros(1, R),
    }
    tensors["rm_scores"][0, r.numel() - 1] = 1.0
    recs = np.empty(1, dtype=object)
    recs[0] = out.extra_fields["traj_steps"]
    non = {"uid": np.array(["g"], dtype=object), "traj_steps": recs,
           "traj_id": np.array([out.extra_fields["traj_id"]], dtype=object)}

    step_rows = expand_step_rows(tensors, non, merge_prefix=False)
    assert step_rows.stats.rows_after == n_calls + 1
    assert step_rows.tensors["rm_scores"].sum(-1).tolist() == [0.0] * n_calls + [1.0]

    merged = expand_step_rows(tensors, non, merge_prefix=True)
    assert merged.stats.rows_after == 1  # verl's token-in/token-out loop: every turn extends the context
    t = merged.tensors
    Pw = t["prompts"].shape[1]
    pl = int(t["attention_mask"][0, :Pw].sum())
    rl = int(t["attention_mask"][0, Pw:].sum())
    assert t["prompts"][0, Pw - pl:].tolist() == out.prompt_ids
    assert t["responses"][0, :rl].tolist() == out.response_ids
    assert t["response_mask"][0, :rl].tolist() == out.response_mask
    assert torch.allclose(t["rollout_log_probs"][0, :rl], lp)
    assert merged.stats.loss_tokens_after == step_rows.stats.loss_tokens_after == int(m.sum())


def test_records_survive_verl_agent_loop_worker_postprocess(tokenizer):
    """verl stacks extra_fields into object arrays; same-length step lists must not be mis-broadcast."""
    from types import SimpleNamespace

    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopWorker, _InternalAgentLoopOutput

    outs = [_run(tokenizer, 1)[0], _run(tokenizer, 1)[0]]  # two trajectories with the same number of steps
    internal = []
    for o in outs:
        P, R = 1024, 512
        p = torch.nn.functional.pad(torch.tensor(o.prompt_ids), (P - len(o.prompt_ids), 0)).unsqueeze(0)
        r = torch.nn.functional.pad(torch.tensor(o.response_ids), (0, R - len(o.response_ids))).unsqueeze(0)
        m = torch.nn.functional.pad(torch.tensor(o.response_mask), (0, R - len(o.response_mask))).unsqueeze(0)
        a = torch.cat([(p != -1).long() * (torch.arange(P) >= P - len(o.prompt_ids)).long(),
                       (torch.arange(R) < len(o.response_ids)).long().unsqueeze(0)], 1)
        internal.append(_InternalAgentLoopOutput(
            prompt_ids=p, response_ids=r, input_ids=torch.cat([p, r], 1), position_ids=torch.clip(a.cumsum(-1) - 1, min=0),
            response_mask=m, attention_mask=a, reward_score=1.0, num_turns=o.num_turns,
            metrics=AgentLoopMetrics(), extra_fields=o.extra_fields,
        ))
    fake = SimpleNamespace(reward_loop_worker_handles=None)
    batch = AgentLoopWorker._postprocess(fake, internal)
    col = batch.non_tensor_batch["traj_steps"]
    assert col.shape == (2,) and all(isinstance(x, dict) and len(x["steps"]) == 2 for x in col)
    assert len(set(batch.non_tensor_batch["traj_id"])) == 2
    out = expand_step_rows({k: v for k, v in batch.batch.items()}, dict(batch.non_tensor_batch), merge_prefix=True)
    assert out.stats.rows_before == 4 and out.stats.rows_after == 2
    assert out.tensors["rm_scores"].sum().item() == pytest.approx(2.0)


def test_truncate_calls_matches_verl_row_budget():
    from verl_traj.integration.agent_loops.stepwise_agent_loop import truncate_calls

    calls = [
        {"prompt_ids": [1] * 5, "response_ids": [2] * 3, "response_logprobs": [-1.0] * 3},
        {"prompt_ids": [1] * 9, "response_ids": [3] * 4, "response_logprobs": [-1.0] * 4},
        {"prompt_ids": [1] * 14, "response_ids": [4], "response_logprobs": [-1.0]},
    ]
    out = truncate_calls(calls, 11)
    assert [len(c["response_ids"]) for c in out] == [3, 2]
    assert len(out[1]["response_logprobs"]) == 2 and len(calls[1]["response_ids"]) == 4  # input untouched


def test_long_last_generation_is_truncated_like_the_row(tokenizer):
    out, server = _run(tokenizer, 3, response_length=10)  # the first generation (19 tokens) overshoots
    steps = decode_step_records(out.extra_fields["traj_steps"])
    assert len(server.seen) == 1 and len(steps) == 1
    assert steps[0]["prompt_ids"].tolist() == out.prompt_ids
    assert steps[0]["response_ids"].tolist() == out.response_ids  # cut at 10 tokens, like verl's row
    assert len(steps[0]["response_logprobs"]) == len(out.response_ids) == 10


def test_shipped_agent_loop_config_registers_the_stepwise_loop():
    """configs/agent_loops/stepwise.yaml (the README's step-wise recipe) names the real class."""
    from pathlib import Path

    import yaml

    from verl_traj.integration.agent_loops.stepwise_agent_loop import AGENT_LOOP_NAME, StepwiseToolAgentLoop

    path = Path(__file__).resolve().parents[2] / "configs" / "agent_loops" / "stepwise.yaml"
    entries = yaml.safe_load(path.read_text())
    assert {e["name"] for e in entries} == {AGENT_LOOP_NAME, "tool_agent"}
    for entry in entries:
        module, _, cls = entry["_target_"].rpartition(".")
        assert getattr(__import__(module, fromlist=[cls]), cls) is StepwiseToolAgentLoop


class _KeyedLoop(StepwiseToolAgentLoop):
    """A loop that names each call's state itself (here: whether it is the first call), for GiGPO's step groups."""

    def anchor_keys(self, calls, output):
        return [("start",) if k == 0 else ("tool", 3) for k in range(len(calls))]


@pytest.mark.parametrize("loop_cls", [StepwiseToolAgentLoop, _KeyedLoop])
def test_each_call_carries_its_anchor_key_default_or_the_loops_own(tokenizer, loop_cls):
    """The default anchor of a call is the hash of the tokens it saw since the previous call (the first: its whole
    prompt; later: the tool response and the chat template around it); a loop's ``anchor_keys`` replaces it (where the
    expansion puts them: ``test_step_groups.py``)."""
    from verl_traj.stepwise.anchors import anchor_key, observation_anchor

    out, server = _run(tokenizer, 2, loop_cls=loop_cls)
    steps = decode_step_records(out.extra_fields["traj_steps"])
    full = [rec["prompt_ids"].tolist() + rec["response_ids"].tolist() for rec in steps]
    if loop_cls is _KeyedLoop:
        expected = [anchor_key(("start",)), anchor_key(("tool", 3)), anchor_key(("tool", 3))]
    else:
        expected = [observation_anchor(server.seen[0])] + [observation_anchor(server.seen[k][len(full[k - 1]):])
                                                            for k in (1, 2)]
        assert expected[1] != expected[0]
    assert [rec["anchor"] for rec in steps] == expected
