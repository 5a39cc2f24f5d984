# Sourced by scripts/report_screenshot.sh and scripts/trace_screenshot.sh: one headless Chromium screenshot of a
# local page, then its colours quantized to 256 so that the PNG stays small.
#   headless_shot URL OUT.png WIDTH,HEIGHT BUDGET_MS PROFILE_DIR [extra chromium flags...]

headless_shot() {
    local url="$1" out="$2" size="$3" budget="$4" profile="$5"
    shift 5
    local browser
    browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
    [[ -n "$browser" ]] || { echo "$0: no chromium on PATH (Debian package chromium)" >&2; exit 2; }
    # --no-sandbox: containers often run as root, where Chromium's sandbox refuses to start; the page is local.
    "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" "$@" \
        --virtual-time-budget="$budget" --window-size="$size" --screenshot="$out" "$url" >/dev/null 2>&1
    python - "$out" <<'PY'
import sys

from PIL import Image

path = sys.argv[1]
Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
PY
    echo "$out: $(du -k "$out" | cut -f1) KiB"
}
