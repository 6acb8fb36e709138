#!/usr/bin/env bash
# Same-seed side by side of the quick start: an older commit against this checkout, interleaved runs.
#   bash scripts/quickstart_side_by_side.sh OLD_COMMIT [STEPS=3] [REPEATS=2]
# Both use this checkout's .venv and one prepared recipe ($VERL_TRAJ_HOME, default ~/.cache/verl_traj); the old
# commit runs from a git worktree under $TMPDIR with PYTHONPATH pointing at it. Prints per-step timing_s/step, gen and
# update_actor of every run, the mean over steps 2.. (step 1 includes warm-up) and each run's rewards (same seed:
# they must agree).
set -euo pipefail
old=${1:?usage: quickstart_side_by_side.sh OLD_COMMIT [STEPS] [REPEATS]}
steps=${2:-3}
repeats=${3:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
git -C "$root" worktree add -q "$work/old" "$old"
trap 'git -C "$root" worktree remove --force "$work/old"' EXIT
. "$root/.venv/bin/activate"
for i in $(seq "$repeats"); do
  for v in old new; do
    src=$([ "$v" = old ] && echo "$work/old" || echo "$root")
    (cd "$src" && PYTHONPATH="$src" VERL_TRAJ_OUT="$work/$v$i" \
       python -m verl_traj.quickstart "trainer.total_training_steps=$steps" > "$work/$v$i.log" 2>&1)
  done
done
python - "$work" "$repeats" <<'PY'
import json, statistics, sys
work, repeats = sys.argv[1], int(sys.argv[2])
keys = ("timing_s/step", "timing_s/gen", "timing_s/update_actor")
for v in ("old", "new"):
    later = {k: [] for k in keys}
    for i in range(1, repeats + 1):
        rows = [json.loads(line) for line in open(f"{work}/{v}{i}/metrics.jsonl")]
        rows = [r.get("data", r) for r in rows]
        for r in rows[1:]:
            for k in keys:
                later[k].append(r[k])
        print(v, i, "rewards", [round(r["critic/score/mean"], 3) for r in rows],
              "step s", [round(r["timing_s/step"], 2) for r in rows])
    print(v, "mean over steps 2..:", {k: round(statistics.mean(x), 2) for k, x in later.items()})
PY
