"""CPU rollout backend for verl (rollout name ``cpu``).

Three pieces, mirroring verl's vLLM/SGLang backends (the model and its decoding: :mod:`verl_traj.cpu.decoding`):

* :class:`CPUGenerationServer`: a Ray actor holding a Hugging Face causal LM (fp32, sdpa by
  default) that serves verl's token-in/token-out API: ``async generate(request_id, prompt_ids,
  sampling_params, ...) -> TokenOutput(token_ids, log_probs)``. Sampling with a KV cache,
  temperature / top-k / top-p / repetition penalty, eos and ``stop_token_ids``, ``max_tokens``,
  per-token log-probs of the temperature-scaled distribution (what verl's actor computes, so
  ``training/rollout_probs_diff_*`` measures the two implementations on the same weights).
  Concurrent requests (verl's agent loop sends a whole rollout at once) are served as static
  batches (left padding, one KV cache, per-row sampling parameters and stops) on a worker thread,
  so the actor's event loop stays free for control calls; weight updates run on the same thread,
  never in the middle of a batch.

  Reproducible sampling (``actor_rollout_ref.rollout.full_determinism=true``, on in the CPU presets):
  verl's agent loops then name every request ``det-{sample index}`` (the same id for all turns of
  a sample). Each call draws from its own generator, seeded by (``rollout.seed``, the weight version
  ``global_steps``, the request id, the call's turn number), and runs in a batch of a fixed shape: only
  requests whose prompts fall in the same width bucket, left-padded to that bucket's width, in batches
  of exactly ``DETERMINISTIC_BATCH`` rows (filled up with one-token dummy rows). CPU matrix kernels
  change their summation order with the matrix shapes, not with the other rows' contents, so a row's
  arithmetic then depends neither on which requests share its batch nor on the order Ray delivers them:
  the same config and seed give the same rollouts -- also after a resume (nothing is kept but the weights).
* :class:`CPUReplica`: verl's ``RolloutReplica``: one server per replica, placed on the node of
  the replica's first trainer worker (hybrid mode), registered as ``cpu`` in
  ``RolloutReplicaRegistry``.
* :class:`CPUServerAdapter`: verl's ``BaseRollout`` living in the actor worker; verl's
  ``ActorRolloutRefWorker.update_weights`` (checkpoint engine backend ``naive``) hands it the
  actor's full tensors after every update, and it pushes them to its replica's server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import time
from typing import Any, Generator, Optional

import ray
import torch
from transformers import DynamicCache

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from verl_traj.cpu.decoding import DecodeState, cfg_get, fixed_shape_chunks, left_padded, load_model, serving_device

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

SERVER_NAME_PREFIX = "verl_traj_cpu_server_"
WIDTH_BUCKET = 64  # deterministic mode: prompts are left-padded to a multiple of this many tokens


def _server_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_NAME_PREFIX}{replica_rank}_{node_rank}"


# ----------------------------------------------------------------------------------------------
# server
# ----------------------------------------------------------------------------------------------
class CPUGenerationServer:
    """Token-in/token-out generation server (wrapped with ``ray.remote`` by :class:`CPUReplica`)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, node_rank: int = 0,
                 rollout_mode: Any = None):
        self.config = config
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.rollout_mode = rollout_mode
        self.global_steps: Optional[int] = None
        self.num_weight_updates = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-gen")
        self._abort = False
        self._debug = int(os.environ.get("VERL_TRAJ_CPU_ROLLOUT_DEBUG", "0") or 0)
        torch.set_num_threads(max(1, int(os.environ.get("VERL_TRAJ_CPU_ROLLOUT_THREADS", "1"))))
        self.device = serving_device()
        self.model, hf_config, self._tokenizer, self.eos_token_ids = load_model(config, model_config, self.device)
        self.max_model_len = int(cfg_get(config, "max_model_len", None) or 0) or int(
            getattr(hf_config, "max_position_embeddings", 4096)
        )
        self.prompt_length = int(cfg_get(config, "prompt_length", 512))
        self.response_length = int(cfg_get(config, "response_length", 512))
        seed = int(cfg_get(config, "seed", 0) or 0) + 1000 * replica_rank
        self._generator = torch.Generator().manual_seed(seed)
        self.deterministic = bool(cfg_get(config, "full_determinism", False))
        self._seed = int(cfg_get(config, "seed", 0) or 0)
        self._turns: dict[tuple, int] = {}
        self.stats = {"requests": 0, "batches": 0, "tokens": 0, "gen_seconds": 0.0}
        # Static batching of concurrent requests (verl's agent loop sends a whole rollout at once);
        # VERL_TRAJ_CPU_ROLLOUT_BATCH=1 serves requests one by one.
        self.max_batch_size = int(os.environ.get("VERL_TRAJ_CPU_ROLLOUT_BATCH", 0) or cfg_get(config, "max_num_seqs", 64) or 64)
        self.batch_wait_s = 0.005
        self._queue: Optional[asyncio.Queue] = None
        self._batch_task = None

    # ---------------------------------------------------------------- generation
    def _max_tokens(self, prompt_len: int, sampling_params: dict) -> int:
        max_possible = self.max_model_len - prompt_len
        if "max_tokens" in sampling_params and sampling_params["max_tokens"] is not None:
            max_tokens = int(sampling_params["max_tokens"])
        elif "max_new_tokens" in sampling_params and sampling_params["max_new_tokens"] is not None:
            max_tokens = int(sampling_params["max_new_tokens"])
        else:
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        return max(1, min(max_tokens, max_possible))

    def _parse(self, prompt_ids: list[int], sampling_params: dict) -> dict:
        sp = sampling_params
        stop = set(int(t) for t in (sp.get("stop_token_ids") or []))
        if not sp.get("ignore_eos", False):
            stop.update(self.eos_token_ids)
        return {
            "prompt": list(prompt_ids),
            "temperature": float(sp["temperature"]) if sp.get("temperature") is not None else 1.0,
            "top_k": int(sp["top_k"]) if sp.get("top_k") is not None else -1,
            "top_p": float(sp["top_p"]) if sp.get("top_p") is not None else 1.0,
            "rep": float(sp.get("repetition_penalty") or 1.0),
            "logprobs": sp.get("logprobs", False) not in (False, None),
            "stop": stop,
            "max_tokens": self._max_tokens(len(prompt_ids), sp),
        }

    @torch.no_grad()
    def _generate_batch_sync(self, requests: list[dict]) -> list[TokenOutput]:
        """Static batch: left-padded prompts, one KV cache, per-row sampling parameters and stops."""
        t0 = time.perf_counter()
        state = DecodeState(requests)
        input_ids, mask = (t.to(self.device) for t in left_padded(requests))
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        past = DynamicCache()
        for _ in range(max(r["max_tokens"] for r in requests)):
            if self._abort:
                state.abort()
                break
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                             past_key_values=past, use_cache=True)
            past = out.past_key_values
            input_ids = state.step(out.logits[:, -1].float().cpu(), self._generator).to(self.device)
            if all(state.done):
                break
            alive = torch.tensor([[0 if d else 1] for d in state.done], dtype=torch.long, device=self.device)
            mask = torch.cat([mask, alive], dim=1)
            position_ids = position_ids[:, -1:] + 1
        self._debug_print(requests, state)
        self.stats["requests"] += len(requests)
        self.stats["batches"] += 1
        self.stats["tokens"] += sum(len(o) for o in state.tokens)
        self.stats["gen_seconds"] += time.perf_counter() - t0
        return [
            TokenOutput(token_ids=state.tokens[i], log_probs=state.logps[i] if r["logprobs"] else None,
                        stop_reason=state.reasons[i], num_preempted=0, extra_fields={"global_steps": self.global_steps})
            for i, r in enumerate(requests)
        ]

    def _debug_print(self, requests: list[dict], state: "DecodeState") -> None:
        """``VERL_TRAJ_CPU_ROLLOUT_DEBUG=N``: print the first N requests served."""
        if self._debug <= 0 or self._tokenizer is None:
            return
        for i in range(min(len(requests), self._debug)):
            print(f"[cpu rollout] prompt={self._tokenizer.decode(requests[i]['prompt'])!r} "
                  f"response={self._tokenizer.decode(state.tokens[i])!r} stop={state.reasons[i]}", flush=True)
        self._debug -= min(len(requests), self._debug)

    def request_generator(self, request_id: Optional[str]) -> torch.Generator:
        """The generator of one call: seeded by (run seed, weight version, request id, turn of that id)."""
        key = (self.global_steps, request_id)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        digest = hashlib.sha256(f"{self._seed}/{self.global_steps}/{request_id}/{turn}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

    async def _serve(self, batch: list) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._generate_batch_sync, [req for req, _ in batch])
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)
        except Exception as e:  # pragma: no cover - surface to every caller
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)

    async def _batch_loop(self):
        while True:
            first = await self._queue.get()
            batch = [first]
            await asyncio.sleep(self.batch_wait_s)  # let concurrent requests of one rollout arrive
            while not self._queue.empty() and len(batch) < self.max_batch_size:
                batch.append(self._queue.get_nowait())
            if not self.deterministic:
                await self._serve(batch)
                continue
            by_width: dict[int, list] = {}
            for item in batch:
                by_width.setdefault(item[0]["width"], []).append(item)
            for width in sorted(by_width):
                for chunk in fixed_shape_chunks(by_width[width]):
                    await self._serve(chunk)

    async def generate(self, request_id: str = None, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       **kwargs: Any) -> TokenOutput:
        if image_data or video_data or kwargs.get("audio_data"):
            raise NotImplementedError("the CPU rollout backend serves text-only models")
        req = self._parse(prompt_ids, dict(sampling_params))
        if self.deterministic:
            req["generator"] = self.request_generator(request_id)
            req["width"] = -(-len(req["prompt"]) // WIDTH_BUCKET) * WIDTH_BUCKET
        loop = asyncio.get_running_loop()
        if self.max_batch_size <= 1:
            return (await loop.run_in_executor(self._executor, self._generate_batch_sync, [req]))[0]
        if self._batch_task is None or self._batch_task.done():
            self._queue = asyncio.Queue()
            self._batch_task = asyncio.ensure_future(self._batch_loop())
        fut = loop.create_future()
        await self._queue.put((req, fut))
        return await fut

    # ---------------------------------------------------------------- weights
    def _load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict:
        own = self.model.state_dict()
        loaded, skipped = 0, []
        with torch.no_grad():
            for name, tensor in state_dict.items():
                target = own.get(name)
                if target is None:
                    skipped.append(name)
                    continue
                target.copy_(tensor.to(target.dtype).view_as(target))
                loaded += 1
        if skipped:
            logger.warning("CPU rollout server: %d unknown weights skipped, e.g. %s", len(skipped), skipped[:3])
        return {"loaded": loaded, "skipped": len(skipped)}

    async def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> dict:
        loop = asyncio.get_running_loop()
        # Runs on the generation thread: never swaps weights in the middle of a request.
        result = await loop.run_in_executor(self._executor, self._load_state_dict, state_dict)
        self.num_weight_updates += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return result

    async def get_weights_checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))

    async def get_stats(self) -> dict:
        return {**self.stats, "num_weight_updates": self.num_weight_updates, "global_steps": self.global_steps}

    async def compute_log_probs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of ``response_ids`` (for tests)."""
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float().cpu() / max(temperature, 1e-8)
        logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
        return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0].tolist()

    # ---------------------------------------------------------------- control (no device memory to free)
    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def wake_up(self, tags: Optional[list[str]] = None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        self._abort = False

    async def wait_for_requests_to_drain(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    async def get_server_address(self):
        return ray.util.get_node_ip_address(), 0


# ----------------------------------------------------------------------------------------------
# replica
# ----------------------------------------------------------------------------------------------
class CPUReplica(RolloutReplica):
    """One :class:`CPUGenerationServer` per replica."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CPUGenerationServer)

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        node_id = None
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        options: dict[str, Any] = {
            "name": _server_name(self.replica_rank) + self.name_suffix,
            "max_concurrency": self.max_concurrency,
            "num_cpus": 0,
        }
        if node_id is not None:
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            )
        server = self.server_class.options(**options).remote(
            config=self.config, model_config=self.model_config, replica_rank=self.replica_rank, node_rank=0,
            rollout_mode=self.rollout_mode,
        )
        address, _ = await server.get_server_address.remote()  # waits for the model to load
        self.servers = [server]
        self._server_handle = server
        # Unique key for verl's load balancer (no HTTP endpoint is served).
        self._server_address = f"{address}:cpu-{self.replica_rank}{self.name_suffix}"


# ----------------------------------------------------------------------------------------------
# adapter in the actor worker
# ----------------------------------------------------------------------------------------------
class CPUServerAdapter(BaseRollout):
    """Client of this worker's replica server; receives the actor's weights after every update."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self._has_server = self.rollout_rank == 0
        self.is_leader_rank = self._has_server
        self.server_handle = None
        self.sleep_level = 1
        self.last_sync_seconds = 0.0

    def _ensure_server_handle(self) -> bool:
        if not self._has_server:
            return False
        if self.server_handle is None:
            self.server_handle = ray.get_actor(_server_name(self.replica_rank))
        return True

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", global_steps: Optional[int] = None,
                             peft_config: Any = None, **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"CPU rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("CPU rollout: LoRA adapters must be merged (model.lora.merge=True)")
        t0 = time.perf_counter()
        has_server = self._ensure_server_handle()
        state_dict = {}
        # Every rank must drain the generator: it all-gathers FSDP shards (a collective). A checkpoint engine's
        # receiver (separate_async: verl_traj.cpu.weight_sync) yields asynchronously, the actor's engine synchronously.
        async for name, tensor in ensure_async_iterator(weights):
            if has_server:
                state_dict[name] = tensor.detach().to("cpu", copy=True)
        if has_server:
            await self.server_handle.update_weights.remote(state_dict, global_steps)
        self.last_sync_seconds = time.perf_counter() - t0
