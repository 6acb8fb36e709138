"""scripts/check_gpu_pins.sh (the evidence for the README's "the GPU pins resolve" claim), run for real with ``bash``
and a stub ``$PYTHON`` standing in for python at the process boundary: ``-m pip install --dry-run --report FILE``
writes a small pip report, ``-m pip index versions flash-attn`` prints what the case sets (or fails like pip without
network), and ``-`` (the script's heredoc) runs the real interpreter. No network.

The pinned flash-attn on a long list passes (an early matcher closing pip's pipe under ``pipefail`` used to turn it
into "not found"); a missing pin, or only its post-releases, fails with "not found"; a failing pip fails as a failing
pip, not as "not found"; an unresolvable extra fails."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_gpu_pins.sh"
PIN = re.search(r"^FLASH_ATTN_VERSION=(\S+)$", (ROOT / "scripts" / "install.sh").read_text(), re.M).group(1)
RESOLVED = {"verl": "0.9.1", "torch": "2.11.0", "vllm": "0.24.0", "transformers": "5.9.0", "tensordict": "0.10.0",
            "ray": "2.49.0", "verl-traj": "0.1.0"}

STUB = r'''
import json, os, sys
args, here = sys.argv[1:], os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "calls.log"), "a") as log:
    log.write(json.dumps(args) + "\n")
if args[:1] == ["-"]:  # the script's heredoc: the real interpreter, same args, same stdin
    os.execv(sys.executable, [sys.executable, *args])
if args[:3] == ["-m", "pip", "install"]:
    if os.path.exists(os.path.join(here, "install.fail")):
        sys.stderr.write("ERROR: ResolutionImpossible: conflicting dependencies\n")
        sys.exit(1)
    assert "--dry-run" in args, args
    with open(args[args.index("--report") + 1], "w") as f:
        json.dump({"install": [{"metadata": {"name": n, "version": v}} for n, v in RESOLVED.items()]}, f)
    sys.exit(0)
if args == ["-m", "pip", "index", "versions", "flash-attn"]:
    case = json.load(open(os.path.join(here, "index.json")))
    sys.stderr.write(case["stderr"])
    sys.stdout.write(case["stdout"])  # a closed pipe raises here, then exits non-zero, as pip does
    sys.stdout.flush()
    sys.exit(case["rc"])
sys.stderr.write(f"stub python: unexpected call {args}\n")
sys.exit(2)
'''


def _run(tmp_path: Path, stdout: str = "", stderr: str = "", rc: int = 0, install_fails: bool = False,
         script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """Run the script with a stub python whose ``pip index versions flash-attn`` prints ``stdout``/``stderr`` and
    exits ``rc``."""
    (tmp_path / "stub.py").write_text(f"RESOLVED = {RESOLVED!r}\n" + STUB)
    (tmp_path / "index.json").write_text(json.dumps({"stdout": stdout, "stderr": stderr, "rc": rc}))
    if install_fails:
        (tmp_path / "install.fail").touch()
    python = tmp_path / "python"  # a shell wrapper: no shebang length limit on sys.executable's path
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / 'stub.py'))} \"$@\"\n")
    python.chmod(0o755)
    return subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=120)


def _index(header: str, versions: list[str]) -> str:
    return f"{header}\nAvailable versions: {', '.join(versions)}\n"


def test_the_pin_on_a_long_list_passes(tmp_path):
    # pip prints the newest version first; 100k older ones make the output far larger than a pipe's buffer, so a
    # matcher that stops at the first line ("flash-attn (PIN)") closes pip's pipe while pip is still writing.
    versions = [f"{PIN}.post2", f"{PIN}.post1", PIN] + [f"1.{i // 1000}.{i % 1000}" for i in range(100_000)]
    run = _run(tmp_path, _index(f"flash-attn ({PIN}.post2)", versions),
               stderr="WARNING: Location 'file:///opt/pypi/simple/flash-attn/' is ignored\n")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"[flash-attn] {PIN} is on PyPI" in run.stdout
    assert "[vllm] resolved 7 packages: verl 0.9.1, torch 2.11.0, vllm 0.24.0, transformers 5.9.0, tensordict " \
           "0.10.0, ray 2.49.0, verl_traj 0.1.0" in run.stdout
    calls = [json.loads(line) for line in (tmp_path / "calls.log").read_text().splitlines()]
    install = next(c for c in calls if c[:3] == ["-m", "pip", "install"])
    assert "--dry-run" in install and install[-1] == ".[vllm]"


@pytest.mark.parametrize("versions", [["2.8.2", "2.8.1", "2.7.4.post1"],
                                      [f"{PIN}.post2", f"{PIN}.post1", f"1{PIN}", "2.8.2"]],
                         ids=["older-only", "post-releases-only"])
def test_a_missing_pin_is_not_found(tmp_path, versions):
    run = _run(tmp_path, _index(f"flash-attn ({versions[0]})", versions))
    assert run.returncode != 0
    assert f"[flash-attn] {PIN} not found on PyPI" in run.stderr
    assert "is on PyPI" not in run.stdout


def test_a_failing_pip_says_so_not_not_found(tmp_path):
    err = "ERROR: Could not fetch URL https://pypi.org/simple/flash-attn/: connection error\n"
    run = _run(tmp_path, stderr=err, rc=1)
    assert run.returncode != 0
    assert "'pip index versions flash-attn' failed" in run.stderr and err.strip() in run.stderr
    assert "not found" not in run.stderr and "is on PyPI" not in run.stdout


def test_an_unresolvable_extra_fails(tmp_path):
    run = _run(tmp_path, _index(f"flash-attn ({PIN})", [PIN]), install_fails=True)
    assert run.returncode != 0 and "ResolutionImpossible" in run.stderr
    assert "is on PyPI" not in run.stdout
