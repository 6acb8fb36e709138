"""Event-loop stalls, and the code they were in: the instrument of ``scripts/bench_agent_loop.py``.

:class:`LoopMonitor` measures, on one asyncio loop, while it is active:

* every callback's wall time and the loop thread's CPU time in it (each ``Handle._run`` of this loop -- a task step, a
  timer, a future's done-callback -- not of other threads' loops, such as TransferQueue's client's); the longest wall
  time is the longest the loop could not serve anything else, a *stall*;
* the garbage collector's pauses (``gc.callbacks``), reported apart and taken out of the callback they fell in (a
  collection runs inside whichever callback allocates, without a stack of its own to sample);
* a heartbeat task's lateness (it sleeps 1 ms, over and over): how late a ready coroutine is served, stalls plus the
  queue of ready callbacks ahead of it;
* where the long callbacks were: a watchdog thread samples the loop thread's stack (``sys._current_frames``) while a
  callback has run longer than ``sample_after_ms``; a sample's owner is its innermost frame of ``verl_traj``'s code or
  verl's (the bench's own frames, the standard library and other packages are skipped: ``other`` without either).

Wall time is what the loop suffered; CPU time is what the code itself cost (a callback can also wait for the GIL held
by another thread -- the tokenizer's executor, TransferQueue's client -- or for a core on a busy machine). Per owner,
the report gives the most CPU time one callback spent in that owner's code (its CPU time net of GC, times the share of
its samples in that code). The watchdog can only sample when the loop thread lets go of the GIL (a torch op, I/O, the
interpreter's switch interval), so samples gather where it does. GC pauses are the whole process's (every thread).
``Handle._run`` is wrapped for the monitor's lifetime only (restored on exit); its cost,
four clock reads per callback, is the same for every variant measured.

:func:`failing_sessions` is one such run: sessions on one loop storing rows in TransferQueue, some failing, under a
session runner (verl_traj's ``run_session``, or another's, ``scripts/bench_replay_poll.py``).
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import transfer_queue as tq

from verl_traj.core.rollout.session_ledger import current_ledger, session_ledger

__all__ = ["LoopMonitor", "StallReport", "failing_sessions", "owner_of"]

OWNERS = ("verl_traj", "verl", "other")


def owner_of(filename: str) -> Optional[str]:
    """``"verl_traj"`` for a file of the package (``/verl_traj/``, not its scripts), ``"verl"`` for verl's
    (``/verl/``), else ``None`` (standard library, asyncio, torch, ray, the bench itself)."""
    path = filename.replace("\\", "/")
    if "/verl_traj/" in path and "/scripts/" not in path:
        return "verl_traj"
    if "/verl/" in path:
        return "verl"
    return None


def _frame_name(frame: Any) -> str:
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}:{frame.f_lineno}"


def _stack_owner(frame: Any) -> tuple[str, str]:
    """The owner of a sampled stack (its innermost verl_traj or verl frame; ``"other"`` without one) and where it
    was: that frame, and the innermost frame of all when it is another's (``verl_frame < torch_frame``)."""
    innermost = frame
    while frame is not None:
        owner = owner_of(frame.f_code.co_filename)
        if owner is not None:
            inner = "" if frame is innermost else f" < {_frame_name(innermost)}"
            return owner, _frame_name(frame) + inner
        frame = frame.f_back
    return "other", _frame_name(innermost)


@dataclass
class StallReport:
    """What one monitored run saw (milliseconds). ``loop_cpu_ms``: the work done on the loop, steadier than its wall
    time on a shared machine. ``max_stall_ms``: the longest callback's wall time net of GC
    pauses, ``stall_cpu_ms`` the loop thread's CPU time in it, ``stall_owner`` / ``where`` its sampled owner and
    frames (most frequent first; ``"-"``: too short to be sampled). ``cpu_ms_by_owner`` / ``where_by_owner``: per
    owner, the most CPU time one callback spent in its code, and where (callbacks shorter than the sampling threshold
    are not attributed)."""

    callbacks: int = 0
    loop_cpu_ms: float = 0.0  # the loop thread's CPU time in all callbacks, GC included
    max_callback_ms: float = 0.0  # GC pauses included
    max_stall_ms: float = 0.0
    stall_cpu_ms: float = 0.0
    max_heartbeat_late_ms: float = 0.0
    max_gc_ms: float = 0.0
    gc_total_ms: float = 0.0
    stall_owner: str = "-"
    where: list[str] = field(default_factory=list)
    cpu_ms_by_owner: dict[str, float] = field(default_factory=dict)
    where_by_owner: dict[str, str] = field(default_factory=dict)


class LoopMonitor:
    """``async with LoopMonitor() as monitor: ...`` around the awaited work; then ``monitor.report()``."""

    def __init__(self, sample_after_ms: float = 3.0, heartbeat_s: float = 0.001):
        self.sample_after = sample_after_ms / 1000.0
        self.heartbeat_s = heartbeat_s
        self.starts: list[float] = []  # per callback, in order: its start (perf_counter)
        self.wall: list[float] = []
        self.cpu: list[float] = []  # the loop thread's CPU time per callback
        self.samples: dict[int, list[tuple[str, str]]] = {}  # callback index -> sampled (owner, frame)
        self.gc_pauses: list[tuple[float, bool, float]] = []  # (start, on the loop thread, seconds) per collection
        self.max_late = 0.0
        self._gc_start = 0.0
        self._current: Optional[tuple[int, float]] = None  # (callback index, start) of the running callback
        self._stop = threading.Event()

    def _wrap(self, original: Any, loop: Any) -> Any:
        monitor, clock, cpu_clock = self, time.perf_counter, time.thread_time

        def _run(handle: Any) -> None:
            if handle._loop is not loop:  # another thread's loop (TransferQueue's client runs one): not measured
                return original(handle)
            index = len(monitor.wall)
            monitor.wall.append(0.0)
            monitor.cpu.append(0.0)
            monitor.starts.append(0.0)
            start, cpu_start = clock(), cpu_clock()
            monitor.starts[index] = start
            monitor._current = (index, start)
            try:
                original(handle)
            finally:
                monitor._current = None
                monitor.wall[index], monitor.cpu[index] = clock() - start, cpu_clock() - cpu_start
        return _run

    def _watch(self, thread_id: int) -> None:
        while not self._stop.wait(0.001):
            current = self._current
            if current is None or time.perf_counter() - current[1] < self.sample_after:
                continue
            frame = sys._current_frames().get(thread_id)
            if frame is not None and self._current is current:
                self.samples.setdefault(current[0], []).append(_stack_owner(frame))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        self.gc_pauses.append((self._gc_start, threading.get_ident() == self._loop_thread,
                               time.perf_counter() - self._gc_start))

    async def _heartbeat(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.heartbeat_s)
            self.max_late = max(self.max_late, time.perf_counter() - start - self.heartbeat_s)

    async def __aenter__(self) -> "LoopMonitor":
        self._loop_thread = threading.get_ident()
        self._original = asyncio.events.Handle._run
        asyncio.events.Handle._run = self._wrap(self._original, asyncio.get_running_loop())
        self._thread = threading.Thread(target=self._watch, args=(self._loop_thread,), daemon=True)
        self._thread.start()
        gc.callbacks.append(self._on_gc)
        self._beat = asyncio.ensure_future(self._heartbeat())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._beat.cancel()
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)
        asyncio.events.Handle._run = self._original

    def _net(self) -> tuple[list[float], list[float]]:
        """Per callback: wall time net of every GC pause that started inside it, CPU time net of the loop thread's
        own (a pause is placed by its start time: the callback that started last before it)."""
        wall, cpu = list(self.wall), list(self.cpu)
        for start, on_loop, seconds in self.gc_pauses:
            index = bisect.bisect_right(self.starts, start) - 1
            if index >= 0 and start <= self.starts[index] + wall[index]:
                wall[index] -= seconds
                cpu[index] -= seconds if on_loop else 0.0
        return wall, cpu

    def report(self) -> StallReport:
        """The run's stalls (:class:`StallReport`)."""
        wall, cpu = self._net()
        if not wall:
            return StallReport()
        longest = max(range(len(wall)), key=wall.__getitem__)
        by_owner: dict[str, tuple[float, int]] = {}
        for index, samples in self.samples.items():
            for owner, count in Counter(o for o, _ in samples).items():
                ms = max(cpu[index], 0.0) * count / len(samples) * 1e3
                if ms > by_owner.get(owner, (0.0, -1))[0]:
                    by_owner[owner] = (ms, index)
        where_by_owner = {o: Counter(w for s, w in self.samples[i] if s == o).most_common(1)[0][0]
                          for o, (_, i) in by_owner.items()}
        sampled = self.samples.get(longest, [])
        return StallReport(
            callbacks=len(wall), loop_cpu_ms=sum(self.cpu) * 1e3, max_callback_ms=max(self.wall) * 1e3,
            max_stall_ms=wall[longest] * 1e3,
            stall_cpu_ms=cpu[longest] * 1e3, max_heartbeat_late_ms=self.max_late * 1e3,
            max_gc_ms=max((seconds for *_, seconds in self.gc_pauses), default=0.0) * 1e3,
            gc_total_ms=sum(seconds for *_, seconds in self.gc_pauses) * 1e3,
            stall_owner=Counter(o for o, _ in sampled).most_common(1)[0][0] if sampled else "-",
            where=[f"{o} {w}" for (o, w), _ in Counter(sampled).most_common(3)],
            cpu_ms_by_owner={o: round(by_owner[o][0], 2) for o in OWNERS if o in by_owner},
            where_by_owner=where_by_owner)


async def failing_sessions(runner: Callable, prefix: str, count: int, calls: int, fail_every: int) -> dict:
    """``count`` sessions of ``calls`` LLM calls on this loop under ``runner`` (``run_session``'s signature), each
    storing a row per call in TransferQueue's ``train`` partition (keys recorded in its ledger first, as verl_traj's
    worker records them), every ``fail_every``-th failing after storing; its group's prompt key is ``{prefix}{i}``.
    Returns the loop's stalls (ms) once it has checked that no failed session left a row and cleared the rest."""
    uids = [f"{prefix}{i:05d}" for i in range(count)]
    await tq.async_kv_batch_put(keys=uids, partition_id="train",
                                tags=[{"is_prompt": True, "status": "running", "global_steps": 0}] * count)

    async def session(i: int) -> None:
        for _ in range(calls):
            await asyncio.sleep(0.002)  # an LLM call
        keys = [f"{uids[i]}_0_{k}" for k in range(calls)]
        current_ledger().stored_keys.extend(keys)
        await tq.async_kv_batch_put(keys=keys, partition_id="train", tags=[{"status": "success"}] * calls)
        if i % fail_every == 0:
            raise RuntimeError("tool died")

    async def one(i: int) -> None:
        with session_ledger():
            await runner(session(i), None, uids[i], 0)

    async with LoopMonitor() as monitor:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
        seconds = time.perf_counter() - start
    failed = sum(isinstance(r, RuntimeError) for r in results)
    left = [key for key in (await tq.async_kv_list(partition_id="train") or {}).get("train", {})
            if key.startswith(prefix)]
    assert sum(k.count("_") == 2 for k in left) == (count - failed) * calls, "a failed session left rows"
    await tq.async_kv_clear(keys=left, partition_id="train")
    report = monitor.report()
    return {"seconds": seconds, "failed": failed, "max_stall_ms": report.max_stall_ms,
            "stall_cpu_ms": report.stall_cpu_ms, "stall_owner": report.stall_owner, "where": report.where[:1],
            "verl_traj_cpu_ms": report.cpu_ms_by_owner.get("verl_traj", 0.0),
            "verl_traj_where": report.where_by_owner.get("verl_traj", "-"),
            "heartbeat_late_ms": report.max_heartbeat_late_ms}
