"""``scripts/bench_agent_loop.py --small`` in this process, on the session's tiny model: the three variants ran the
same sessions through the real v1 agent-loop workers, every prompt finished, and the rows stored are what each variant
stores: verl's one row per session, ``traj.enable=false`` one row per LLM call, verl_traj the prefix-merged step rows
whose merge tags account for every LLM call (3 per session). The table carries its fields; the stall monitor saw
callbacks; ``--pieces`` timed verl_traj's per-session pieces on a recorded 3-call session.

TransferQueue is an in-memory stand-in here (:class:`_MemoryQueue`: its key-value calls, tags merged per key as TQ's
controller merges them), so the test starts no Ray (Ray + TQ cost about 14 s to start and stop on 2 cores); the
benchmark itself runs on the real one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import transfer_queue

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_agent_loop.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_agent_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _MemoryQueue:
    """TransferQueue's async key-value calls the agent-loop workers and the benchmark make, in memory: per partition,
    each key's tags (merged on every put, as TQ merges them) and its stored row count."""

    def __init__(self):
        self.tags: dict[str, dict[str, dict]] = {}

    def install(self, monkeypatch) -> None:
        for name in ("async_kv_put", "async_kv_batch_put", "async_kv_list", "async_kv_clear"):
            monkeypatch.setattr(transfer_queue, name, getattr(self, name))
        monkeypatch.setattr(transfer_queue, "init", lambda *a, **k: None)

    async def async_kv_put(self, key, partition_id, fields=None, tag=None):
        await self.async_kv_batch_put([key], partition_id, fields, [tag or {}])

    async def async_kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        assert fields is None or fields.batch_size[0] == len(keys)
        for key, tag in zip(keys, tags or [{}] * len(keys)):
            self.tags.setdefault(partition_id, {}).setdefault(key, {}).update(tag)

    async def async_kv_list(self, partition_id=None):
        return {partition_id: {k: dict(t) for k, t in self.tags.get(partition_id, {}).items()}}

    async def async_kv_clear(self, keys, partition_id):
        for key in keys:
            self.tags.get(partition_id, {}).pop(key, None)


def test_small_mode_runs_every_variant_on_the_same_sessions(tiny_home, capsys, monkeypatch):
    bench = _script()
    queue = _MemoryQueue()
    queue.install(monkeypatch)
    monkeypatch.setattr(bench, "start_transfer_queue", lambda: None)
    payload = bench.main(["--small", "--pieces", "--json", "--home", str(tiny_home)])
    assert capsys.readouterr().out.strip().startswith("{")  # --json: stdout is the payload only
    table = {row["variant"]: row for row in payload["table"]}
    assert set(table) == {"verl", "traj_off", "verl_traj"} and payload["turns"] == 3
    for row in table.values():
        assert row["sessions"] == 8 and row["repeats"] == 1 and row["step_s"] > 0
        # step_s is rounded to 1 ms: per session that is up to 0.0625 ms on 8 sessions
        assert row["per_session_ms"] == pytest.approx(row["step_s"] / 8 * 1e3, rel=1e-2, abs=0.07)
        assert {"max_stall_ms", "stall_cpu_ms", "stall_owner", "cpu_ms_by_owner", "gc_ms_per_step",
                "max_heartbeat_late_ms"} <= set(row)
    assert table["verl"]["rows_per_session"] == 1 and table["verl"]["recorded_calls_per_session"] == 0
    assert table["traj_off"]["rows_per_session"] == 3  # stock verl on step rows: one per LLM call
    assert table["verl_traj"]["rows_per_session"] == 1  # the tool loop's calls continue one context: one merged row
    assert table["verl_traj"]["recorded_calls_per_session"] == 3  # ... holding every call, per its merge tag
    assert {"vs_verl", "vs_traj_off"} <= set(table["verl_traj"])
    pieces = {piece["piece"].split(" ")[0]: piece for piece in payload["pieces"]}
    assert {"encode_step_records", "step_outputs", "tags-only"} <= set(pieces)
    assert all(piece["ms"] > 0 and piece["calls"] == 3 for piece in pieces.values())
    runs = payload["runs"]
    assert [r["variant"] for r in runs] == ["verl", "traj_off", "verl_traj"]
    assert all(r["stalls"]["callbacks"] > 0 for r in runs)
    assert not queue.tags.get("train")  # every step's rows were found and cleared
