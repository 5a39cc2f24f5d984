#!/usr/bin/env bash
# The main job: set up (or reuse) .venv, run the smoke sweep on CPU and render its report.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
STORE="results/smoke/$(date -u +%Y%m%d-%H%M%S)"
# The report is rendered whatever the sweep's exit code (failed points are shown as failed); the
# script then exits with the sweep's code, so a failure is still seen.
sweep_rc=0
moebench run smoke --out "$STORE" "$@" || sweep_rc=$?
if [ -f "$STORE/meta.json" ]; then
    moebench report "$STORE" -o reports/smoke
    echo "report: $ROOT/reports/smoke/report.html (and report.md)"
fi
exit "$sweep_rc"
