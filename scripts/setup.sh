#!/usr/bin/env bash
# Create .venv and install ray_mmbatch with its test tools.
# torch: on a machine without an NVIDIA GPU we pin the CPU build that this kind of
# machine keeps on disk (installs in seconds); with a GPU (or TORCH_SPEC set) the
# normal PyPI torch is used. Set TORCH_SPEC="torch==X.Y" to choose yourself.
# --reference also makes .venv-ref: the interpreter the video tests run HF's video processors in
# (they need torchvision, which does not load beside the CPU torch: PyPI's torch 2.14.1 + torchvision
# 0.29.1, torchcodec 0.17.0, this transformers, PyAV; tests/video_reference.py). Kept apart so that the project's own
# environment stays what a user installs.
set -euo pipefail
REFERENCE=0
for arg in "$@"; do
  case "$arg" in
    --reference) REFERENCE=1 ;;
    *) echo "usage: scripts/setup.sh [--reference]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"
  else
    TORCH_SPEC="torch==2.13.0"
  fi
fi
python -c "import torch" >/dev/null 2>&1 || python -m pip install -q "$TORCH_SPEC"
python -m pip install -q -e ".[dev]"
# Byte-compile the project once: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), no
# process writes .pyc files, and each Ray worker and command would otherwise compile the modules it imports
# (up to ~0.2 CPU s a process). Cached .pyc files are still read, and a stale one is recompiled in memory.
python -m compileall -q ray_mmbatch jobs >/dev/null
python -c "import ray, torch, transformers, PIL, pyarrow; print('setup ok: ray', ray.__version__, 'torch', torch.__version__)"
if [ "$REFERENCE" = 1 ]; then
  TRANSFORMERS=$(python -c "import transformers; print(transformers.__version__)")
  deactivate
  [ -x .venv-ref/bin/python ] || "$PY" -m venv .venv-ref
  .venv-ref/bin/python -c "import torchvision, transformers, av; assert transformers.__version__ == '$TRANSFORMERS'" \
    >/dev/null 2>&1 || .venv-ref/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1" \
    "transformers==$TRANSFORMERS" av pillow numpy
  # torchcodec: HF's video processors decode a path with it (tests/video_reference.py runs it on PyAV's FFmpeg)
  .venv-ref/bin/python -c "import torchcodec" >/dev/null 2>&1 || .venv-ref/bin/python -m pip install -q \
    "torchcodec==0.17.0"
  .venv-ref/bin/python -c "import torch, torchvision; print('reference ok: torch', torch.__version__, 'torchvision', torchvision.__version__)"
fi
