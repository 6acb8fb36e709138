"""Anchor keys of LLM calls: which state a call acted from, for GiGPO's step groups (:mod:`.step_groups`).

A key is a positive 63-bit integer, the same in every process and run (blake2b, never Python's salted ``hash``):

* by default, :func:`observation_anchor` of the tokens the call saw since the previous call: its context after
  the longest common prefix with the previous call's full context (prompt + response). When the chain holds that
  is the observation (a tool result and the chat template around it); for the first call, the whole prompt; when
  the loop rewrote its context (a sliding window), everything after the common prefix; when the call saw nothing
  new (it continues its own previous output), its whole context (:func:`observation_tokens`). It describes the
  latest observation, not the whole state: identical short results reached from different states (``OK``, one error
  text) share a key, and a rewritten context puts earlier responses into it. Where that matters, the loop gives
  its own keys.
* an agent loop's own key
  (:meth:`~verl_traj.integration.agent_loops.stepwise_agent_loop.StepRecordingMixin.anchor_keys`), for environments
  whose state is not the text, or for matching similar observations: a ``str``, ``bytes``, ``int`` or a tuple of them,
  hashed by :func:`anchor_key`.

Pure module: numpy, torch and hashlib.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError

__all__ = ["anchor_key", "observation_anchor", "observation_anchors", "observation_tokens"]

_MASK = (1 << 63) - 1


def _digest(data: bytes, kind: bytes) -> int:
    value = int.from_bytes(hashlib.blake2b(kind + data, digest_size=8).digest(), "little") & _MASK
    return value or 1  # 0 marks "no call starts here" in step_anchors


def observation_tokens(prompt: torch.Tensor, shared: int) -> torch.Tensor:
    """What a call with context ``prompt`` saw since the previous call, whose context + response shares the first
    ``shared`` tokens with it: ``prompt[shared:]``, or the whole ``prompt`` where that is empty."""
    return prompt[shared:] if shared < prompt.numel() else prompt


def observation_anchor(tokens: Any) -> int:
    """The anchor key of a call that saw ``tokens`` (1-D token ids) since the previous call."""
    ids = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    return observation_anchors(ids.reshape(-1), np.asarray([ids.size]))[0]


def observation_anchors(ids: np.ndarray, lengths: np.ndarray) -> list[int]:
    """:func:`observation_anchor` of many calls at once: ``ids`` ``[sum lengths]`` the calls' observations one
    after another, ``lengths`` ``[C]``; the ids' bytes are made once, then one digest a call."""
    data = np.ascontiguousarray(ids, dtype=np.int64).tobytes()
    ends = (np.cumsum(lengths, dtype=np.int64) * 8).tolist()
    return [_digest(data[lo:hi], b"obs:") for lo, hi in zip([0] + ends[:-1], ends)]


def _canonical(value: Any) -> bytes:
    if isinstance(value, bool) or value is None:
        raise TypeError(type(value).__name__)
    if isinstance(value, (int, np.integer)):
        return b"i" + str(int(value)).encode()
    if isinstance(value, str):
        return b"s" + value.encode()
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, tuple):
        parts = [_canonical(v) for v in value]
        return b"t" + b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    raise TypeError(type(value).__name__)


def anchor_key(value: Any, where: str = "anchor key") -> int:
    """An agent loop's own anchor (``str``, ``bytes``, ``int`` or a tuple of them) as a key; anything else is
    refused, naming ``where``."""
    try:
        return _digest(_canonical(value), b"user:")
    except TypeError as exc:
        raise TrajInputError.invalid(
            where, value, f"is a {exc.args[0]}, not a str, bytes, int or tuple of them",
            "return one hashable state description per LLM call from anchor_keys (e.g. the observation text, or a "
            "tuple describing the environment's state)") from None
