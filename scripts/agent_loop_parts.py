"""The pieces ``scripts/bench_agent_loop.py`` runs the v1 agent-loop worker with, in this process: each variant's
config (``configs/quickstart.yaml``, composed as ``python -m verl_traj.main_ppo`` composes it) and worker class, an LLM
server, load balancer and reward handle that answer at once (called like Ray actors: ``.remote(...)``), and the
calculator prompts as the trainer's dataloader collates them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.utils import create_rl_dataset
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
from verl.utils.dataset.rl_dataset import collate_fn
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from verl_traj.integration.agent_loops.v1_agent_loop import TrajAgentLoopWorkerTQ, _actor_base
from verl_traj.integration.async_modes.v1_staleness import recording_client_class
from verl_traj.recipes.calc_agent.prepare import write_data
from verl_traj.testing.engine import compose_config

__all__ = ["AGENT_NAME", "OVERRIDES", "STOCK_ENTRY", "VARIANTS", "StubBalancer", "StubReward", "StubServer",
           "make_worker", "prompt_rows", "variant_config"]

VARIANTS = ("verl", "traj_off", "verl_traj")
# hydra overrides of configs/quickstart.yaml per variant (the model and the turn limit are added to each)
OVERRIDES = {
    "verl": ["traj.enable=false", "traj.step_wise=false", "algorithm.adv_estimator=grpo",
             "actor_rollout_ref.rollout.agent.agent_loop_config_path=null"],
    "traj_off": ["traj.enable=false"],
    "verl_traj": [],
}
AGENT_NAME = "tool_agent"  # the calculator data's agent_name (configs/agent_loops/stepwise.yaml maps it to recording)
STOCK_ENTRY = {"_target_": "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"}  # verl's own registration


class _Remote:
    """An attribute called like a Ray actor method: ``.remote(...)``."""

    def __init__(self, fn: Any):
        self.remote = fn


class StubServer:
    """An LLM server that answers at once: the calculator call until the prompt holds ``turns - 1`` tool responses,
    then the final answer (token ids of the tiny tokenizer, log-probs -0.5, policy version 1)."""

    def __init__(self, tokenizer: Any, turns: int):
        call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call><|im_end|>'
        self.call = tokenizer.encode(call, add_special_tokens=False)
        self.answer = tokenizer.encode("<answer>7</answer><|im_end|>", add_special_tokens=False)
        self.tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.turns = turns
        self.generate = _Remote(self._generate)

    async def _generate(self, *, prompt_ids: list[int], **_: Any) -> Any:
        ids = self.call if prompt_ids.count(self.tool_response) < self.turns - 1 else self.answer
        return TokenOutput(token_ids=list(ids), log_probs=[-0.5] * len(ids), stop_reason="completed",
                           extra_fields={"global_steps": 1})


class StubBalancer:
    """verl's global load balancer with one server (the LLM client asks it for a server per request)."""

    def __init__(self, server: StubServer):
        async def no_fields() -> list:
            return []

        async def acquire(**_: Any) -> tuple:
            return "s0", server

        self.require_acquire_fields = _Remote(no_fields)
        self.require_release_fields = _Remote(no_fields)
        self.acquire_server = _Remote(acquire)
        self.release_server = _Remote(lambda **_: None)


class StubReward:
    """A reward-loop worker handle that scores every trajectory 1.0 at once."""

    def __init__(self):
        async def score(data: Any) -> dict:
            return {"reward_score": 1.0, "reward_extra_info": {"acc": 1.0}}

        self.compute_score = _Remote(score)


def variant_config(variant: str, model: str, turns: int) -> Any:
    """configs/quickstart.yaml as ``python -m verl_traj.main_ppo`` composes it, resolved, with the variant's
    overrides, rows long enough for ``turns`` calls without truncation."""
    sizes = [f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max(turns, 5)}",  # the task's 5 at least
             "data.max_prompt_length=512", f"data.max_response_length={max(256, 128 * turns)}"]  # no truncation
    return compose_config("quickstart", [*OVERRIDES[variant], f"actor_rollout_ref.model.path={model}", *sizes])


def make_worker(variant: str, config: Any, turns: int) -> tuple[Any, dict]:
    """The variant's worker class, instantiated in this process as Ray would (config, LLM client, no teacher, reward
    handles), and the agent-loop registry entry its ``tool_agent`` resolves to (the registry is one per process)."""
    cls = _actor_base(AgentLoopWorkerTQ) if variant == "verl" else TrajAgentLoopWorkerTQ
    _agent_loop_registry[AGENT_NAME] = STOCK_ENTRY  # the worker registers its config's loops over verl's
    # as the trainers build it: verl_traj's records each call (the lengths and versions traj_bias/* need)
    client = (LLMServerClient if variant == "verl" else recording_client_class(None))(config, load_balancer_handle=None)
    worker = cls(config, client, None, [StubReward()])
    client._load_balancer = StubBalancer(StubServer(worker.tokenizer, turns))
    entry = _agent_loop_registry[AGENT_NAME]
    _agent_loop_registry[AGENT_NAME] = STOCK_ENTRY
    return worker, entry


def prompt_rows(config: Any, tokenizer: Any, counts: list[int], data_dir: Path) -> dict[int, dict]:
    """For each prompt count, that many rows of the calculator data (written here as the recipe's ``prepare`` writes
    it) as the trainer's dataloader collates them (verl's RLHFDataset and collate function)."""
    write_data(data_dir / "data", max(counts), 1, seed=0, max_operand=9)
    dataset = create_rl_dataset([str(data_dir / "data" / "train.parquet")], config.data, tokenizer, None)
    return {count: collate_fn([dataset[i] for i in range(count)]) for count in counts}
