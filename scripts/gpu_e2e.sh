#!/usr/bin/env bash
# One whole GRPO training run through `python -m verl_traj.main_ppo` on one GPU, the prefix-tree default against rows
# and against stock verl with the attention stock verl runs there (issues 41 item 4, 55 item 5; what runs and what it reports: scripts/gpu_e2e.py's docstring). Results into $OUT (gpu_e2e.txt
# the table, gpu_e2e.json, each run's metrics and log tail, summary.txt).
#
#   bash scripts/gpu_e2e.sh --download          # here, with PyPI: the wheels into .whl_e2e (under 64 MiB with the tree)
#   OUT=/some/dir bash scripts/gpu_e2e.sh       # on the GPU machine, repo root (device run: carry [".whl_e2e"])
#   DEVICE=cpu STEPS=2 bash scripts/gpu_e2e.sh  # the same stages on CPU (the suite's dry run)
#   bash scripts/gpu_e2e.sh --dry-run           # every stage's command line
#
# Knobs (environment): DEVICE (cuda | cpu), RUNS (tree rows stock; cpu: tree rows), STEPS (10), SHAPE (0.5b | tiny), DEADLINE (560 s for everything: the
# machine's 10 minutes less its start), OUT, WORK, SITE, WHL, PYTHON; hydra overrides after the options go to every run.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [ "${1:-}" = "--download" ]; then
  grep -qx '/.whl_e2e/' .git/info/exclude 2>/dev/null || echo '/.whl_e2e/' >>.git/info/exclude
  exec "$PY" scripts/gpu_bundle.py download --set e2e --dest "${WHL:-.whl_e2e}"
fi
exec "$PY" scripts/gpu_e2e.py "$@"
