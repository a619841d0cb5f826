#!/usr/bin/env bash
# Render a run report with headless Chromium and check the screenshot is a real page.
#
#   scripts/check_report_render.sh [RUN_DIR|report.html] [OUT.png]
#
# No argument: writes a generated 2-rank pack-mode run (tests/test_report.py's
# write_fake_run) to a temp dir and reports on it. A RUN_DIR without report.html
# gets one from jobs/report.py first. Chromium runs with networking features off,
# so a page that needed a CDN would render blank and fail the check below.
# Checks: PNG over 100 KB and over 500 distinct colours (a blank or error page has
# a handful; plotly charts with a few hundred markers have thousands).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
TARGET=${1:-}
PNG=${2:-$(mktemp -d)/report.png}

if [ -z "$TARGET" ]; then
  TARGET=$(mktemp -d)/run
  python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from test_report import write_fake_run; write_fake_run(Path('$TARGET'))"
fi
if [ -d "$TARGET" ]; then
  [ -f "$TARGET/report.html" ] || python jobs/report.py "$TARGET" >/dev/null
  HTML="$TARGET/report.html"
else
  HTML="$TARGET"
fi
[ -f "$HTML" ] || { echo "no report at $HTML" >&2; exit 1; }

CHROME=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$CHROME" ]; then
  echo "chromium missing: installing (apt-get install -y chromium)" >&2
  apt-get install -y chromium >/dev/null
  CHROME=$(command -v chromium)
fi

PROFILE=$(mktemp -d)
# --virtual-time-budget lets plotly finish drawing before the screenshot is taken.
"$CHROME" --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --no-first-run --disable-sync --user-data-dir="$PROFILE" \
  --hide-scrollbars --virtual-time-budget=10000 \
  --screenshot="$PNG" --window-size=1400,2400 "file://$(realpath "$HTML")" 2>/dev/null
rm -rf "$PROFILE"

python - "$PNG" <<'PY'
import os, sys
from PIL import Image
png = sys.argv[1]
size = os.path.getsize(png)
img = Image.open(png).convert("RGB")
colours = len(img.getcolors(maxcolors=1 << 24))
print(f"{png}: {img.size[0]}x{img.size[1]}, {size / 1024:.0f} KB, {colours} distinct colours")
if img.size != (1400, 2400) or size < 100_000 or colours < 500:
    sys.exit("render check FAILED: screenshot looks blank or broken")
print("render check ok")
PY
