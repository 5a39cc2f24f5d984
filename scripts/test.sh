#!/usr/bin/env bash
# The test command: set up (or reuse) .venv, lint with ruff, run the test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
ruff check moebench tests scripts
python -m pytest -q "$@"
