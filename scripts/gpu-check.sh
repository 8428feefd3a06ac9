#!/usr/bin/env bash
# Diffuse on one NVIDIA GPU, from a fresh clone, in under 10 minutes:
#   1. a virtualenv with a CUDA build of torch (the interpreter's own where it already has one; else torch
#      $TORCH_VERSION from PyPI, whose Linux x86-64 wheels are CUDA builds, or from $TORCH_INDEX_URL when set;
#      never the CPU wheel the README's install line pins), and Diffuse with its test tools (pip needs PyPI);
#   2. the GPU tests (pytest -m gpu: Wan, Flux and Qwen2 tiny split over 2 GPU nodes against whole on the GPU,
#      bytes and tokens equal; a mixed GPU/CPU ring with its measured difference);
#   3. python -m diffuse.bench device: Wan2.1-1.3B's configuration with random bf16 weights, 256x256, 9 frames,
#      whole against 2 nodes sharing the GPU at P=1 and P=2;
#   4. python -m diffuse.bench lm on the GPU.
# A step that fails is reported and the next one still runs; the exit status is 1 if any failed.
# Everything it prints goes to gpu-check.log as well. Run it from the repository root or anywhere:
#   bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
LOG=${LOG:-gpu-check.log}
exec > >(tee "$LOG") 2>&1

started=$(date +%s)
say() { echo "== $(( $(date +%s) - started )) s: $*"; }
failed=""
step() { local name=$1; shift; "$@" || { echo "== FAILED: $name (exit $?)"; failed="$failed $name"; }; }

command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi here: this script needs an NVIDIA GPU"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
uptime || true

say "installing into $VENV"
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages "$VENV"    # the interpreter's CUDA torch, as it is
    . "$VENV/bin/activate"
else
    "$PYTHON" -m venv "$VENV"
    . "$VENV/bin/activate"
    pip install -q --upgrade pip
    if [ -n "$TORCH_INDEX_URL" ]; then
        pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    else
        pip install -q "torch==$TORCH_VERSION"  # PyPI's Linux x86-64 wheel: a CUDA build
    fi
fi
pip install -q -e . pytest pytest-timeout
python - <<'PY'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

export HF_HUB_OFFLINE=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
say "the GPU tests"
step "gpu tests" timeout 300 python -m pytest -m gpu tests/test_gpu.py -q -s -rs -p no:cacheprovider

say "bench device: Wan2.1-1.3B configuration, bf16, 256x256, 9 frames, whole vs 2 nodes on the GPU, P=1 and P=2"
step "bench device" timeout 240 python -m diffuse.bench device --device cuda --dtype bfloat16 --steps 5

say "bench lm on the GPU"
step "bench lm" timeout 120 python -m diffuse.bench lm --device cuda

if [ -n "$failed" ]; then
    say "done, with failures:$failed (see above, and $LOG)"
    exit 1
fi
say "done: figures above, and in $LOG"
