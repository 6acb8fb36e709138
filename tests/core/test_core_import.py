"""`import verl_traj.core` stays pure: no verl, ray or transformers module gets imported."""

from __future__ import annotations

import json
import subprocess
import sys


def test_core_import_is_pure():
    code = (
        "import sys, json, torch, numpy\n"
        "import verl_traj.core, verl_traj.stepwise, verl_traj.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray', 'transformers'))\n"
        "print(json.dumps({'bad': bad}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bad"] == []
