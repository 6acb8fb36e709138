"""`import verl_traj.core` stays pure (no verl / ray / transformers) and cheap on top of torch."""

from __future__ import annotations

import json
import subprocess
import sys


def test_core_import_is_pure_and_fast():
    code = (
        "import sys, time, json, torch, numpy\n"
        "t = time.perf_counter(); import verl_traj.core; dt = time.perf_counter() - t\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray', 'transformers'))\n"
        "print(json.dumps({'dt': dt, 'bad': bad}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bad"] == []
    assert out["dt"] < 0.5, out  # measured ~0.01 s on top of torch
