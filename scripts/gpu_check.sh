#!/usr/bin/env bash
# GPU checks (NCCL smoke, bf16 training of a tiny Qwen2-VL, verify_packing in bf16 and fp32; a tiny InternVL
# and a tiny Gemma 3: bf16 training and verify_packing in bf16).
#
#   bash scripts/gpu_check.sh [DIR]
#
# On a machine with the project's venv and a GPU: prepares DIR (default runs/gpu_check) and runs
# the checks. On a GPU machine without Ray (a lent device): prepare DIR on a CPU machine first
# (`python scripts/gpu_check.py prepare DIR`), copy it over, and run this script there; it then
# skips the preparation. Record the printed JSON in benchmarks/RESULTS.md ("GPU checks").
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-runs/gpu_check}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ ! -d "$DIR/ckpt" ] || [ ! -d "$DIR/internvl/ckpt" ]; then
  "$PY" scripts/gpu_check.py prepare "$DIR"
fi
nvidia-smi -L || true
"$PY" -c "import flash_attn" 2>/dev/null && echo "flash_attn installed" || echo "flash_attn not installed: sdpa"
PYTHONUNBUFFERED=1 "$PY" scripts/gpu_check.py run "$DIR"
