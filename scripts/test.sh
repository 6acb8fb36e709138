#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. Fails if pytest collects no test.
#   bash scripts/test.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
. "${VENV:-.venv}/bin/activate"
python -m pytest -ra --durations=25 "$@" tests
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing (exit 5 must not pass silently)" >&2
  exit 1
fi
exit "$rc"
