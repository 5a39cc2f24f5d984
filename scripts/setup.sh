#!/usr/bin/env bash
# Create or reuse .venv and install moebench with pinned dependencies.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (a stamp skips work).
# MOEBENCH_EXTRAS: comma-separated extras of pyproject.toml to install too, e.g.
#   MOEBENCH_EXTRAS=e2e bash scripts/setup.sh   # transformers, the other side of `moebench bench e2e`
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MOEBENCH_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${MOEBENCH_EXTRAS:-}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# torch: keep one that is already installed (e.g. a CUDA build on a GPU node); otherwise pin
# 2.13.0. On these CPU machines that takes the local CPU build; elsewhere set
# TORCH_INDEX_URL (e.g. the CPU wheel index) to choose the build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -c "import torch" || { echo "setup: torch failed to install" >&2; exit 1; }
fi

STAMP="$VENV/.moebench-stamp"
WANT="$( (cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml"; echo "extras=$EXTRAS") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    "${PIP[@]}" install -r "$ROOT/requirements.txt" 2>&1 | grep -v "is ignored" || true
    "${PIP[@]}" install --no-deps -e "$ROOT" 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -c "import moebench, torch, pandas, matplotlib, click" || exit 1
    if [ -n "$EXTRAS" ]; then  # with their dependencies (the pins live in pyproject.toml); torch is kept
        "${PIP[@]}" install -e "$ROOT[$EXTRAS]" 2>&1 | grep -v "is ignored" || true
    fi
    if [[ ",$EXTRAS," == *,e2e,* ]]; then
        "$VENV/bin/python" -c "import transformers" || { echo "setup: the e2e extra failed to install" >&2; exit 1; }
    fi
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
