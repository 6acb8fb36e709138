"""Step rows of whole chains, vectorised over every LLM call of a batch: the expansion's common case.

A source row's records form a *chain* when they are delta-encoded (:func:`~verl_traj.stepwise.expand.
encode_step_records`: ``prompt_prefix_len`` + ``prompt_tail_ids``, numpy arrays) and every call's context extends
the previous call's whole context (``prompt_prefix_len`` = the previous prompt + response; 0 for the first call).
Then the trajectory is one token stream ``tail_0 r_0 tail_1 r_1 ...``: call ``k``'s prompt is the stream up to
``r_k``, its merged row (``traj.merge_prefix``) ``tail_0`` followed by the rest of the stream. :func:`chain_rows`
builds every such row of the batch with index arithmetic on the concatenated calls (no Python loop over rows or
tokens; one list comprehension per record field reads the records, which arrive as Python objects).

Every record the per-trajectory path would read differently (full ``prompt_ids``, lists or tensors instead of
arrays, a context that does not extend the previous one, a value it would refuse: negative ids, NaN log-probs, a
mask that is not 0/1, a bad reward or anchor) sends its whole source row to that path, which is the reference:
the rows built here are equal to its rows (``tests/stepwise/test_chains.py``), and its errors stay the errors.

Pure module: torch, numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from verl_traj.stepwise.anchors import observation_anchors
from verl_traj.stepwise.flat_rows import FlatRows, segment_index
from verl_traj.stepwise.prefix_merge import MergeStats

__all__ = ["chain_rows"]

_MAX_ANCHOR = 1 << 63


def _row_steps(raw: Any) -> Optional[list]:
    """A row's records as a non-empty list (the path's input), else None (the row takes the per-trajectory path)."""
    steps = raw.get("steps") if type(raw) is dict else raw
    return steps if type(steps) is list and steps else None


def _ids(x: Any) -> bool:
    return type(x) is np.ndarray and x.ndim == 1 and (x.dtype.kind == "i" or (x.dtype.kind == "u" and x.itemsize < 8))


def _plain_call(c: Any, has_lp: bool) -> bool:
    """The record has the types this path reads (values are checked vectorised afterwards)."""
    if type(c) is not dict or c.get("prompt_ids") is not None or c.get("parent") is not None or "outcome" in c:
        return False  # a branching session's call (a parent, a leaf outcome) takes the per-trajectory path
    r, p = c.get("response_ids"), c.get("prompt_prefix_len", 0)
    if not (_ids(c.get("prompt_tail_ids")) and _ids(r) and (type(p) is int or isinstance(p, np.integer))):
        return False
    lp, m, w, a = c.get("response_logprobs"), c.get("response_mask"), c.get("reward"), c.get("anchor")
    return ((not has_lp or (type(lp) is np.ndarray and lp.ndim == 1 and lp.dtype.kind == "f" and lp.size == r.size))
            and (m is None or (type(m) is np.ndarray and m.ndim == 1 and m.dtype.kind in "biu" and m.size == r.size))
            and (w is None or type(w) in (int, float) or isinstance(w, (np.floating, np.integer)))
            and (a is None or type(a) is int or isinstance(a, np.integer)))


@dataclass
class _Calls:
    """The calls of the rows on this path, concatenated in row order (``C`` calls, ``F`` rows)."""

    rows: np.ndarray  # [F] source rows
    count: np.ndarray  # [F] calls per row
    recs: list  # [C] the records
    tail_len: np.ndarray  # [C]
    resp_len: np.ndarray  # [C]
    tail: np.ndarray  # [sum tail_len] int64
    resp: np.ndarray  # [sum resp_len] int64

    @property
    def row_of_call(self) -> np.ndarray:
        return np.repeat(np.arange(self.rows.size), self.count)

    def per_row_all(self, ok: np.ndarray) -> np.ndarray:
        """``[F]``: every call of the row is ``ok``."""
        return np.bincount(self.row_of_call, weights=~ok, minlength=self.rows.size) == 0


def _gather(records: Sequence, rows: np.ndarray, has_lp: bool) -> tuple[Optional[_Calls], np.ndarray]:
    """The calls of the candidate ``rows`` whose records all have the path's types; ``(calls, rows left over)``."""
    steps = [_row_steps(records[b]) for b in rows.tolist()]
    listed = np.fromiter((s is not None for s in steps), dtype=bool, count=len(steps))
    steps = [s for s in steps if s is not None]
    count = np.fromiter(map(len, steps), dtype=np.int64, count=len(steps))
    recs = [c for s in steps for c in s]
    plain = np.fromiter((_plain_call(c, has_lp) for c in recs), dtype=bool, count=len(recs))
    row_of_call = np.repeat(np.arange(len(steps)), count)
    row_ok = np.bincount(row_of_call, weights=~plain, minlength=len(steps)) == 0
    if not row_ok.all():
        keep = np.repeat(row_ok, count)
        recs, count = [c for c, k in zip(recs, keep) if k], count[row_ok]
    rest = np.concatenate([rows[~listed], rows[listed][~row_ok]])
    if not recs:
        return None, rest
    tails = [c["prompt_tail_ids"] for c in recs]
    resps = [c["response_ids"] for c in recs]
    calls = _Calls(rows[listed][row_ok], count, recs, np.fromiter(map(len, tails), np.int64, len(recs)),
                   np.fromiter(map(len, resps), np.int64, len(recs)), _cat(tails, np.int64), _cat(resps, np.int64))
    return calls, rest


def _cat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _per_call_any(bad_token: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[C]``: the call has a flagged token (``bad_token`` over its ``lengths`` tokens, concatenated)."""
    owner = np.repeat(np.arange(lengths.size), lengths)
    return np.bincount(owner[bad_token], minlength=lengths.size) > 0


@dataclass
class _Values:
    """Response-side values of the calls (``[sum resp_len]``) and each call's anchor key."""

    mask: np.ndarray  # int64 0/1
    log_probs: Optional[np.ndarray]  # float32
    reward: np.ndarray  # float32, each call's turn reward on its last token
    anchor: Optional[np.ndarray]  # [C] int64 keys (None: not asked for)


def _values(calls: _Calls, has_lp: bool, anchors: bool) -> tuple[_Values, np.ndarray]:
    """The calls' response-side values and ``[C]`` which calls the per-trajectory path would accept as they are."""
    recs, n = calls.recs, calls.resp_len
    ok = ~_per_call_any(calls.tail < 0, calls.tail_len) & ~_per_call_any(calls.resp < 0, n)
    given = [c.get("response_mask") for c in recs]
    mask = np.ones(int(n.sum()), dtype=np.int64)
    with_mask = np.fromiter((m is not None for m in given), bool, len(given))
    if with_mask.any():  # the calls that record a loss mask (all ones otherwise)
        at = segment_index(torch.from_numpy(np.cumsum(n) - n)[with_mask], torch.from_numpy(n[with_mask])).numpy()
        mask[at] = _cat([m for m in given if m is not None], np.int64)
    ok &= ~_per_call_any((mask != 0) & (mask != 1), n)
    lp = None
    if has_lp:
        lp = _cat([c["response_logprobs"] for c in recs], np.float32)
        ok &= ~_per_call_any(np.isnan(lp) | (lp == np.inf), n)
    reward = np.zeros(int(n.sum()), dtype=np.float32)
    raw = [c.get("reward") for c in recs]
    has_reward = np.fromiter((w is not None for w in raw), bool, len(raw))
    if has_reward.any():
        value = np.asarray([float(w) if w is not None else 0.0 for w in raw], dtype=np.float64)
        ok &= ~has_reward | (np.isfinite(value) & (n > 0))
        at = (np.cumsum(n) - 1)[has_reward & ok]
        reward[at] = value[has_reward & ok].astype(np.float32)
    return _Values(mask, lp, reward, _anchor_keys(calls, ok) if anchors else None), ok & _anchors_ok(recs)


def _anchors_ok(recs: list) -> np.ndarray:
    own = [c.get("anchor") for c in recs]
    return np.fromiter((a is None or 0 < int(a) < _MAX_ANCHOR for a in own), bool, len(own))


def _anchor_keys(calls: _Calls, ok: np.ndarray) -> np.ndarray:
    """``[C]`` int64 each call's anchor: its record's own (the step-recording agent loop records the default key
    with the call, :func:`~verl_traj.stepwise.records.encode_step_records`), else the hash of the tokens it saw since
    the previous call (:func:`observation_anchor`, only for the calls without one; a call that saw nothing new takes
    the per-trajectory path). Calls not ``ok`` get 1."""
    own = [c.get("anchor") for c in calls.recs]
    missing = np.fromiter((a is None for a in own), bool, len(own))
    keys = np.fromiter(((int(a) if 0 < int(a) < _MAX_ANCHOR else 1) if a is not None else 1 for a in own), np.int64,
                       len(own))
    hashed = missing & (calls.tail_len > 0)
    if hashed.any():
        starts = np.cumsum(calls.tail_len) - calls.tail_len
        at = segment_index(torch.from_numpy(starts[hashed]), torch.from_numpy(calls.tail_len[hashed])).numpy()
        keys[hashed] = observation_anchors(calls.tail[at], calls.tail_len[hashed])
    ok &= ~(missing & (calls.tail_len == 0))
    return keys


def _chained(calls: _Calls) -> tuple[np.ndarray, np.ndarray]:
    """``(ok [C], start [C])``: the call's ``prompt_prefix_len`` is its row's stream length before it (0 for the first
    call) -- the chain holds; ``start``: that length."""
    seg = calls.tail_len + calls.resp_len
    before = np.cumsum(seg) - seg
    row_start = np.repeat(before[np.cumsum(calls.count) - calls.count], calls.count)
    start = before - row_start
    try:
        given = np.fromiter((c.get("prompt_prefix_len", 0) for c in calls.recs), np.int64, len(calls.recs))
    except OverflowError:
        return np.zeros(start.size, dtype=bool), start
    return given == start, start


def chain_rows(records: Sequence, rows: np.ndarray, *, has_lp: bool, merge: bool,
               anchors: bool) -> tuple[Optional[FlatRows], MergeStats, np.ndarray]:
    """The step rows of the candidate source ``rows`` whose records form chains (module docstring).

    Args:
        records: ``[B]`` each source row's records (the batch's steps column).
        rows: ``[F]`` int64 candidate source rows, ascending.
        has_lp: the batch has rollout log-probs (every record must carry ``response_logprobs``).
        merge: one row per trajectory (``traj.merge_prefix``), else one row per call.
        anchors: fill :attr:`FlatRows.anchor` (GiGPO's step groups).
    Returns:
        ``(rows built or None, their MergeStats, the source rows left to the per-trajectory path)``.
    """
    calls, rest = _gather(records, np.asarray(rows, dtype=np.int64), has_lp)
    if calls is None:
        return None, MergeStats(), np.sort(rest)
    values, ok = _values(calls, has_lp, anchors)
    chained, start = _chained(calls)
    row_ok = calls.per_row_all(ok & chained)
    if not row_ok.all():
        rest = np.concatenate([rest, calls.rows[~row_ok]])
        calls, values, start = _select(calls, values, start, row_ok)
    if calls is None:
        return None, MergeStats(), np.sort(rest)
    flat, stats = _build(calls, values, start, merge)
    return flat, stats, np.sort(rest)


def _select(calls: _Calls, values: _Values, start: np.ndarray, row_ok: np.ndarray):
    """Only the calls of the rows ``row_ok``."""
    call_ok = np.repeat(row_ok, calls.count)
    if not call_ok.any():
        return None, None, None
    tail_ok, resp_ok = np.repeat(call_ok, calls.tail_len), np.repeat(call_ok, calls.resp_len)
    kept = _Calls(calls.rows[row_ok], calls.count[row_ok], [c for c, k in zip(calls.recs, call_ok) if k],
                  calls.tail_len[call_ok], calls.resp_len[call_ok], calls.tail[tail_ok], calls.resp[resp_ok])
    vals = _Values(values.mask[resp_ok], None if values.log_probs is None else values.log_probs[resp_ok],
                   values.reward[resp_ok], None if values.anchor is None else values.anchor[call_ok])
    return kept, vals, start[call_ok]


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def _scattered(where: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[len(where)]``: ``values`` in order at the True positions of ``where``, 0 elsewhere."""
    return torch.zeros(where.numel(), dtype=dtype).masked_scatter_(where, values.to(dtype))


def _response_side(calls: _Calls, values: _Values, is_resp: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token fields of rows whose response side is ``ids`` (``is_resp``: which of them are the calls' response
    tokens, in order; the others are observations: mask, log-prob, reward and anchor 0)."""
    out = {"ids": ids, "mask": _scattered(is_resp, _t(values.mask), torch.long),
           "turn_reward": _scattered(is_resp, _t(values.reward), torch.float32)}
    if values.log_probs is not None:
        out["log_probs"] = _scattered(is_resp, _t(values.log_probs), torch.float32)
    if values.anchor is not None:  # each call's key on its first response token
        first = np.zeros(int(calls.resp_len.sum()), dtype=bool)
        first[(np.cumsum(calls.resp_len) - calls.resp_len)[calls.resp_len > 0]] = True
        keys = _scattered(_t(first), _t(values.anchor[calls.resp_len > 0]), torch.long)
        out["anchor"] = _scattered(is_resp, keys, torch.long)
    return out


def _merged(calls: _Calls, values: _Values) -> tuple[dict, torch.Tensor, dict]:
    """One row per trajectory: its first call's prompt, then the stream ``r_0 tail_1 r_1 ...``."""
    first = np.cumsum(calls.count) - calls.count
    seg_len = np.stack([calls.tail_len, calls.resp_len], 1).reshape(-1)
    kind = np.tile(np.array([1, 2], dtype=np.int8), calls.tail_len.size)  # 1: tail, 2: response
    kind[2 * first] = 0  # the first tail: the row's prompt
    kind = _t(np.repeat(kind, seg_len))
    stream = torch.zeros(kind.numel(), dtype=torch.long)
    stream.masked_scatter_(kind < 2, _t(calls.tail).long())
    stream.masked_scatter_(kind == 2, _t(calls.resp).long())
    side = kind > 0
    row_len = np.add.reduceat(calls.tail_len + calls.resp_len, first) if first.size else first
    count = _t(calls.count)
    meta = dict(prompt_len=_t(calls.tail_len[first]), response_len=_t(row_len - calls.tail_len[first]),
                source_row=_t(calls.rows), step_index=torch.zeros_like(count), first_step=torch.zeros_like(count),
                last_step=count - 1, is_last=torch.ones(count.numel(), dtype=torch.bool))
    return meta, stream[kind == 0], _response_side(calls, values, kind[side] == 2, stream[side])


def _unmerged(calls: _Calls, values: _Values, start: np.ndarray) -> tuple[dict, torch.Tensor, dict]:
    """One row per call: the stream up to its response (prompt), then its response."""
    seg = _t(calls.tail_len + calls.resp_len)
    begin = torch.cumsum(seg, 0) - seg
    kind = _t(np.repeat(np.tile(np.array([True, False]), calls.tail_len.size),
                        np.stack([calls.tail_len, calls.resp_len], 1).reshape(-1)))
    stream = torch.zeros(kind.numel(), dtype=torch.long)
    stream.masked_scatter_(kind, _t(calls.tail).long())
    stream.masked_scatter_(~kind, _t(calls.resp).long())
    count, n = _t(calls.count), int(seg.numel())
    first = torch.cumsum(count, 0) - count
    k = torch.arange(n) - torch.repeat_interleave(first, count, output_size=n)
    prompt_len = _t(start + calls.tail_len)
    prompt = stream[segment_index(torch.repeat_interleave(begin[first], count, output_size=n), prompt_len)]
    meta = dict(prompt_len=prompt_len, response_len=_t(calls.resp_len),
                source_row=torch.repeat_interleave(_t(calls.rows), count, output_size=n), step_index=k, first_step=k,
                last_step=k, is_last=k == torch.repeat_interleave(count - 1, count, output_size=n))
    resp = _t(calls.resp).long()
    return meta, prompt, _response_side(calls, values, torch.ones(resp.numel(), dtype=torch.bool), resp)


def _build(calls: _Calls, values: _Values, start: np.ndarray, merge: bool) -> tuple[FlatRows, MergeStats]:
    """The rows of whole chains: one per row (``merge``) or one per call."""
    meta, prompt, side = _merged(calls, values) if merge else _unmerged(calls, values, start)
    flat = FlatRows(prompt=prompt, response=side["ids"], mask=side["mask"], log_probs=side.get("log_probs"),
                    turn_reward=side["turn_reward"], anchor=side.get("anchor"), tree_call=None,
                    tree_outcome=None, **meta)
    full_len = int((start + calls.tail_len + calls.resp_len).sum())
    loss = int(np.count_nonzero(values.mask))
    stats = MergeStats(rows_before=int(calls.resp_len.size), rows_after=flat.num_rows, tokens_before=full_len,
                       tokens_after=int((flat.prompt_len + flat.response_len).sum()), loss_tokens_before=loss,
                       loss_tokens_after=loss)
    return flat, stats
