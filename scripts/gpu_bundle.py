"""The wheels a GPU machine without a package index needs, as one bundle under the 64 MiB a device call carries.

The GPU image holds torch, transformers, pandas, pyarrow, grpcio, protobuf, msgpack, aiohttp and more
(/work/.library/device/KINDS.md) but not verl, Ray or verl_traj. Two sets:

* ``update`` (``scripts/gpu_update_ab.sh``): verl 0.9.1's import-time needs, at the versions the project's CPU venv
  runs (Ray is stubbed there: that script never starts it);
* ``e2e`` (``scripts/gpu_e2e.sh``, a whole training run through ``python -m verl_traj.main_ppo``): the same, Ray
  (cp312, without the parts :data:`RAY_DROP` lists: its Java jars, the dashboard's web client and the rllib / tune /
  train / serve / data / llm / workflow libraries, which neither verl nor verl_traj imports), jsonschema and its
  family (Ray's core needs them), and verl_traj's own wheel (its verl plugin is an entry point: only an installed
  distribution registers it).

Commands::

    python scripts/gpu_bundle.py download --set e2e --dest .whl_e2e   # needs PyPI; prints the manifest, checks size
    python scripts/gpu_bundle.py strip-installed SITE                 # this interpreter's Ray, less RAY_DROP, in SITE
    python scripts/gpu_bundle.py check --dest .whl_e2e                # the size check alone (JSON manifest)

``strip-installed`` is the CPU dry run's stand-in for the bundle (whose wheels are cp312): the same Ray, minus the
same parts, linked into ``SITE`` ahead of the interpreter's own on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # what one device call carries: the working tree and every carried path together
TREE_ALLOWANCE = 6 * 2**20  # the working tree (about 3.6 MB now) and what a run leaves beside it
# verl 0.9.1's import-time needs that the GPU image lacks, at the CPU venv's versions; tensordict's C++ extension links
# no torch (any torch works). antlr4 4.9.3 has no wheel on PyPI: built from its source (pure Python).
VERL_WHEELS = ("verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 importlib_metadata==10.2.0 omegaconf==2.3.1 "
               "hydra-core==1.3.8 codetiming==1.4.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 "
               "typing-inspection==0.4.5 uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 "
               "datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0 cachetools==8.0.2 "
               "TransferQueue==0.1.11 msgspec==0.22.0 pyzmq==27.3.0").split()
SOURCE_ONLY = ("antlr4-python3-runtime==4.9.3",)
RAY = "ray==2.60.0"
RAY_NEEDS = ("jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1")
SETS = {"update": VERL_WHEELS, "e2e": (*VERL_WHEELS, *RAY_NEEDS)}
RAY_DROP = ("jars", "rllib", "tune", "train", "serve", "data", "llm", "workflow", "dashboard/client")
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
            "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _dropped(name: str) -> bool:
    return any(name == f"ray/{d}" or name.startswith(f"ray/{d}/") for d in RAY_DROP)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip_ray_wheel(src: Path, dest_dir: Path) -> Path:
    """``src`` (Ray's wheel) rewritten into ``dest_dir`` without :data:`RAY_DROP`, its RECORD listing what is left."""
    out = dest_dir / src.name
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        # the wheel's own RECORD (top-level .dist-info), not a vendored package's
        record_name = next(n for n in zin.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))
        record = []
        for info in zin.infolist():
            if _dropped(info.filename) or info.filename == record_name:
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            record.append(_record_line(info.filename, data))
        zout.writestr(record_name, "\n".join([*record, f"{record_name},,"]) + "\n")
    tmp.replace(out)
    return out


def manifest(dest: Path) -> dict:
    """Every wheel in ``dest`` with its size, the total, and whether it fits the carry limit beside the tree."""
    wheels = {p.name: p.stat().st_size for p in sorted(dest.glob("*.whl"))}
    total = sum(wheels.values())
    return {"dest": str(dest), "wheels": wheels, "total_bytes": total, "total_mib": round(total / 2**20, 1),
            "limit_mib": round((CARRY_LIMIT - TREE_ALLOWANCE) / 2**20, 1), "fits": total <= CARRY_LIMIT - TREE_ALLOWANCE}


def download(which: str, dest: Path) -> dict:
    """The set ``which`` into ``dest`` (Ray stripped; ``e2e``: verl_traj's wheel too); returns :func:`manifest`."""
    dest.mkdir(parents=True, exist_ok=True)
    _pip("download", "-q", "--no-deps", *PLATFORM, "-d", str(dest), *SETS[which])
    _pip("wheel", "-q", "--no-deps", "-w", str(dest), *SOURCE_ONLY)
    if which == "e2e":
        raw = dest / "raw"
        raw.mkdir(exist_ok=True)
        _pip("download", "-q", "--no-deps", *PLATFORM, "-d", str(raw), RAY)
        for wheel in raw.glob("ray-*.whl"):
            strip_ray_wheel(wheel, dest)
            wheel.unlink()
        raw.rmdir()
        for old in dest.glob("verl_traj-*.whl"):
            old.unlink()
        _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(ROOT))
    return manifest(dest)


def strip_installed(site: Path) -> Path:
    """This interpreter's Ray linked into ``site/ray`` entry by entry, less :data:`RAY_DROP` (the bundle's Ray)."""
    import importlib.util

    src = Path(importlib.util.find_spec("ray").origin).parent
    dest = site / "ray"
    dest.mkdir(parents=True, exist_ok=True)

    def link(rel: str) -> None:
        for child in sorted((src / rel).iterdir()):
            name = f"{rel}/{child.name}".strip("/")
            if _dropped(f"ray/{name}") or (dest / name).exists() or child.name == "__pycache__":
                continue
            if any(d.startswith(name + "/") for d in RAY_DROP):  # a parent of a dropped part: link its children
                (dest / name).mkdir()
                link(name)
            else:
                os.symlink(child, dest / name)

    link("")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download")
    d.add_argument("--set", choices=sorted(SETS), required=True)
    d.add_argument("--dest", type=Path, required=True)
    c = sub.add_parser("check")
    c.add_argument("--dest", type=Path, required=True)
    s = sub.add_parser("strip-installed")
    s.add_argument("site", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "strip-installed":
        print(strip_installed(a.site))
        return 0
    report = download(a.set, a.dest) if a.cmd == "download" else manifest(a.dest)
    print(json.dumps(report, indent=1))
    if not report["fits"]:
        print(f"the bundle is {report['total_mib']} MiB, over {report['limit_mib']} MiB (64 MiB a call, less the "
              "working tree): drop a wheel the GPU image already has, or more of Ray (RAY_DROP)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
