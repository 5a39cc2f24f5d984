#!/usr/bin/env bash
# The GPU check (see moebench.bench.gpu_check.py): CUDA-only tests, grouped GEMM and MoE layer
# timings against the dense bf16 matmul rate, fp8/mxfp8 vs bf16, sync-free routing, `small` training
# runs compiled vs eager in bf16 and fp8, NVML.
# Usage: scripts/gpu_check.sh OUT_DIR [--repeats N] [--skip tests,...] [--ranks N]   (at most 9 minutes on one H200;
# --ranks N also checks every parallel layout on N GPUs against one)
# Exit 0: every section passed (or was skipped); 1: a section failed (wrong result, crash or timeout).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 ]]; then
    echo "usage: $0 OUT_DIR [gpu_check options]" >&2
    exit 2
fi
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
cd "$ROOT"
exec timeout 570 "$PY" -m moebench.bench.gpu_check "$@"
