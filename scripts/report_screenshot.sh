#!/usr/bin/env bash
# The top of a rendered report as a PNG, as docs/img/report-*.png are made:
#   scripts/report_screenshot.sh REPORT_DIR OUT.png [HEIGHT]
# Headless Chromium at 1400 px wide and HEIGHT px tall (default 1100: the Answer, the Runs lines and the
# start of the points table), then the colours quantized to 256 so that the PNG stays small.
set -euo pipefail
report="${1:?usage: $0 REPORT_DIR OUT.png [HEIGHT]}"
out="${2:?usage: $0 REPORT_DIR OUT.png [HEIGHT]}"
height="${3:-1100}"
[[ -f "$report/report.html" ]] || { echo "$0: $report/report.html: no report there (moebench report ... -o $report)" >&2; exit 2; }
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[[ -n "$browser" ]] || { echo "$0: no chromium on PATH (Debian package chromium)" >&2; exit 2; }
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
# --no-sandbox: containers often run as root, where Chromium's sandbox refuses to start; the page is our own.
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
    --virtual-time-budget=10000 --window-size="1400,$height" --screenshot="$out" \
    "file://$(cd "$report" && pwd)/report.html" >/dev/null 2>&1
python - "$out" <<'EOF'
import sys

from PIL import Image

path = sys.argv[1]
Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
EOF
echo "$out: $(du -k "$out" | cut -f1) KiB"
