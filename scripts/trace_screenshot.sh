#!/usr/bin/env bash
# One rank's Chrome trace (train.trace=true) opened in speedscope, as docs/img/trace-speedscope.png is made:
#   scripts/trace_screenshot.sh TRACE.json[.gz] SPEEDSCOPE_DIR OUT.png
# SPEEDSCOPE_DIR is the npm package `speedscope` (npm install speedscope@1.25.0 -> node_modules/speedscope):
# its dist/release/index.html is the whole viewer and runs offline, unlike Perfetto's UI. Headless Chromium at
# 1600 x 900, then the colours quantized to 256 so that the PNG stays small. docs/report.md ("Traces") says
# what speedscope shows of a moebench trace and what it cannot.
set -euo pipefail
usage="usage: $0 TRACE.json[.gz] SPEEDSCOPE_DIR OUT.png"
trace="${1:?$usage}"
viewer="${2:?$usage}"
out="${3:?$usage}"
[[ -f "$trace" ]] || { echo "$0: $trace: no such trace" >&2; exit 2; }
[[ -f "$viewer/dist/release/index.html" ]] || { echo "$0: $viewer/dist/release/index.html: not the speedscope package (npm install speedscope)" >&2; exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/headless_shot.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# What speedscope's own command line writes: a script that hands the file to the page. Only the complete (X)
# and metadata (M) events: with the profiler's flow events (s/f) speedscope stops with "Could not find events
# for key: undefined"; the events' args are dropped, or speedscope appends them to every name.
python - "$trace" "$work/profile.js" <<'EOF'
import base64
import gzip
import json
import sys
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
with (gzip.open if src.suffix == ".gz" else open)(src, "rt") as f:
    data = json.load(f)
events = data.get("traceEvents", []) if isinstance(data, dict) else data
keep = [{k: v for k, v in e.items() if k != "args" or e["ph"] == "M"} for e in events
        if isinstance(e, dict) and e.get("ph") in ("X", "M")
        and isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int)]
payload = base64.b64encode(json.dumps({"traceEvents": keep}).encode()).decode()
dst.write_text(f"speedscope.loadFileFromBase64({json.dumps(src.name)}, {json.dumps(payload)})")
EOF
headless_shot "file://$(cd "$viewer" && pwd)/dist/release/index.html#localProfilePath=$work/profile.js" "$out" \
    1600,900 15000 "$work/profile" --allow-file-access-from-files
