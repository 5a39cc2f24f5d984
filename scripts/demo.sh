#!/usr/bin/env bash
# The main job: set up (or reuse) .venv, then train the tiny preset on CPU and print its summary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
moebench train --preset tiny "$@"
