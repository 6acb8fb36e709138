"""The CPU rollout server's model and decoding, apart from its serving (:mod:`verl_traj.cpu.rollout`): the model
loaded for generation, per-token sampling (temperature, top-k / top-p, repetition penalty) with the log-prob of the
temperature-scaled distribution, and a static batch's decode state; the fixed-shape batches of the deterministic mode.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from verl.utils.fs import copy_to_local

from verl_traj.cpu.detect import cpu_platform_wanted
from verl_traj.integration.config.attention_names import TORCH_VARLEN

__all__ = ["DETERMINISTIC_BATCH", "DecodeState", "cfg_get", "eos_ids", "filter_logits", "fixed_shape_chunks",
           "left_padded", "load_model", "sample_token", "serving_device"]

DETERMINISTIC_BATCH = 8  # deterministic mode: every static batch has exactly this many rows


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:
            pass
    return getattr(cfg, key, default)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p of a [V] logits vector."""
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        remove = cum - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    return logits


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: Optional[torch.Generator]) -> tuple[int, float]:
    """Returns (token, log-prob under softmax(logits / temperature)); greedy when temperature <= 0."""
    logits = logits.float()
    if temperature is None or temperature <= 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = filter_logits(scaled, top_k, top_p)
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])


def eos_ids(local_path: str, hf_config: Any, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the model's config, generation config and tokenizer name."""
    eos: set[int] = set()

    def add(e: Any) -> None:
        eos.update(e if isinstance(e, (list, tuple)) else ([e] if e is not None else []))

    add(getattr(hf_config, "eos_token_id", None))
    try:
        add(GenerationConfig.from_pretrained(local_path).eos_token_id)
    except Exception:  # no generation_config.json: fine
        pass
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return sorted(eos)


def serving_device() -> torch.device:
    """Where the server's model runs: the CPU where verl_traj's CPU platform is active (no accelerator, or
    ``VERL_TRAJ_CPU=1``), else the first CUDA device (the server asks Ray for no GPU, and Ray then leaves
    ``CUDA_VISIBLE_DEVICES`` as the node has it: the server shares the trainer's GPU, as a colocated vLLM does).
    Sampling stays on the host either way (one ``[b, V]`` copy of the last logits per token)."""
    return torch.device("cpu") if cpu_platform_wanted() or not torch.cuda.is_available() else torch.device("cuda", 0)


def load_model(config: Any, model_config: Any, device: torch.device = torch.device("cpu")):
    """``(model, hf_config, tokenizer or None, eos ids)``: the causal LM on ``device``, in eval mode, no grad."""
    local_path = copy_to_local(cfg_get(model_config, "local_path") or cfg_get(model_config, "path"))
    override = dict(cfg_get(model_config, "override_config", {}) or {})
    trust = bool(cfg_get(model_config, "trust_remote_code", False))
    dtype = _DTYPES.get(str(cfg_get(config, "dtype", "float32")), torch.float32)
    hf_config = AutoConfig.from_pretrained(local_path, trust_remote_code=trust)
    attn = override.get("attn_implementation") or "sdpa"
    attn = "sdpa" if attn == TORCH_VARLEN else attn  # generation (KV cache, left padding) needs no flash path on CUDA
    model = AutoModelForCausalLM.from_pretrained(local_path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(local_path, trust_remote_code=trust)
    except Exception:  # a model directory without a tokenizer: ids only, no debug decoding
        tokenizer = None
    return model, hf_config, tokenizer, eos_ids(local_path, hf_config, tokenizer)


def left_padded(requests: list[dict], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, W]`` left-padded prompt ids and their attention mask (``W``: the longest prompt, or the
    requests' common bucket ``width`` in deterministic mode)."""
    width = max(max(len(r["prompt"]), r.get("width", 0)) for r in requests)
    input_ids = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for i, r in enumerate(requests):
        n = len(r["prompt"])
        input_ids[i, width - n:] = torch.tensor(r["prompt"], dtype=torch.long)
        mask[i, width - n:] = 1
    return input_ids, mask


def fixed_shape_chunks(items: list) -> list[list]:
    """Batches of exactly ``DETERMINISTIC_BATCH`` (request, future) pairs, the last filled with dummy rows:
    a copy of its first request that stops after one token, with a future nobody awaits."""
    chunks = [items[i:i + DETERMINISTIC_BATCH] for i in range(0, len(items), DETERMINISTIC_BATCH)]
    last = chunks[-1]
    dummy = dict(last[0][0], max_tokens=1, generator=torch.Generator().manual_seed(0))
    loop = asyncio.get_event_loop()
    last += [(dummy, loop.create_future()) for _ in range(DETERMINISTIC_BATCH - len(last))]
    return chunks


class DecodeState:
    """Per-request sampled tokens, log-probs, stop reasons and repetition sets of one static batch."""

    def __init__(self, requests: list[dict]):
        self.requests = requests
        n = len(requests)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logps: list[list[float]] = [[] for _ in range(n)]
        self.reasons = ["length"] * n
        self.done = [False] * n
        self.seen = [set(r["prompt"]) if r["rep"] != 1.0 else None for r in requests]

    def abort(self) -> None:
        for i, d in enumerate(self.done):
            if not d:
                self.reasons[i], self.done[i] = "aborted", True

    def step(self, logits: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        """Sample one token for every live request from ``logits`` ``[b, V]``; returns the next ``[b, 1]`` ids."""
        next_ids = torch.zeros((len(self.requests), 1), dtype=torch.long)
        for i, r in enumerate(self.requests):
            if self.done[i]:
                continue
            row = logits[i]
            if self.seen[i]:
                idx = torch.tensor(sorted(self.seen[i]), dtype=torch.long)
                vals = row[idx]
                row[idx] = torch.where(vals > 0, vals / r["rep"], vals * r["rep"])
            token, logp = sample_token(row, r["temperature"], r["top_k"], r["top_p"], r.get("generator", generator))
            self.tokens[i].append(token)
            self.logps[i].append(logp)
            next_ids[i, 0] = token
            if self.seen[i] is not None:
                self.seen[i].add(token)
            if token in r["stop"]:
                self.reasons[i], self.done[i] = "completed", True
            elif len(self.tokens[i]) >= r["max_tokens"]:
                self.done[i] = True
        return next_ids
