#!/usr/bin/env bash
# The main job: set up (or reuse) .venv, run the smoke sweep on CPU and render its report.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
STORE="results/smoke/$(date -u +%Y%m%d-%H%M%S)"
moebench run smoke --out "$STORE" "$@"
moebench report "$STORE" -o reports/smoke
echo "report: $ROOT/reports/smoke/report.html (and report.md)"
