#!/usr/bin/env bash
# Create .venv and install ray_mmbatch with its test tools.
# torch: on a machine without an NVIDIA GPU we pin the CPU build that this kind of
# machine keeps on disk (installs in seconds); with a GPU (or TORCH_SPEC set) the
# normal PyPI torch is used. Set TORCH_SPEC="torch==X.Y" to choose yourself.
set -euo pipefail
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
python -c "import ray, torch, transformers, PIL, pyarrow; print('setup ok: ray', ray.__version__, 'torch', torch.__version__)"
