#!/usr/bin/env bash
# The GPU check (see moebench.bench.gpu_check.py): numerics of the quantized GEMMs at real routing
# sizes, sync-free routing, training that trains (vs an lr=0 control), scope=linear, the phase clock,
# the triton backend through the trainer, MoE layer and grouped GEMM rates against the dense bf16
# matmul rate (MFU plausibility), `small` training runs compiled vs eager in bf16 and fp8, NVML.
# Each section runs in its own process with its own time budget; a table of PASS/FAIL/WARN/SKIP
# per section prints last and OUT_DIR/gpu_check.json holds it all.
# Usage: scripts/gpu_check.sh OUT_DIR [--repeats N] [--skip tests,...] [--ranks N]   (at most 9 minutes on one H200;
# --ranks N also checks every parallel layout on N GPUs against one)
# Exit 0: no section failed (each passed, warned or was skipped); 1: a section failed (wrong result,
# crash or timeout); 2: bad arguments; 124: this script's 570 s hard timeout.
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
