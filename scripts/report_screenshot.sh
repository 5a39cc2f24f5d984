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
source "$(dirname "${BASH_SOURCE[0]}")/headless_shot.sh"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
headless_shot "file://$(cd "$report" && pwd)/report.html" "$out" "1400,$height" 10000 "$profile"
