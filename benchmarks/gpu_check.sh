#!/usr/bin/env bash
# The GPU check: the torch runtime on a CUDA device, in one short session on a machine without internet.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT if set, else gpu-check/)
#
# 1. the tests marked `cuda` (tests/test_cuda.py): fused training of zoo models on the GPU equals each model trained
#    alone by torch.optim on the same GPU;
# 2. a short benchmark (benchmarks/runtime_bench.py): LeNet, ResNet-18 and a small Transformer LM, B in 1, 8, 32,
#    64, the fused array on the torch runtime vs the same B models trained one after another in PyTorch on the GPU,
#    a torch.func (vmap) ensemble of them, the HFTA-style model fused by hand and one model at batch B*N (the
#    ceiling).
#
# Needs Python with torch built for CUDA, onnx, numpy, safetensors, pyyaml, tqdm, matplotlib, scikit-learn (newer
# versions are fine). What is missing is installed from benchmarks/wheels/ (pydantic, pytest; fetch them where
# there is internet with `make gpu-wheels`). onnxfuse itself is not installed: it is imported from this checkout.
# Everything goes to OUT_DIR: versions.txt, nvidia-smi.txt, tests.txt, bench.{md,json,csv,png}, log.txt.
# On a machine where torch sees no CUDA device it says so and exits 0. GPU_CHECK_DRY_RUN=1 runs the same steps on
# the CPU with tiny sizes (to test the script itself; its figures mean nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT:-gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1

DEVICE=cuda BENCH_ARGS=(--B 1,8,32,64 --steps 10 --rounds 3)
if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
    DEVICE=cpu BENCH_ARGS=(--B 1,2 --steps 2 --rounds 1 --warmup 1)
    echo "gpu_check: dry run on the CPU"
elif ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: skipped: $PY has no torch that sees a CUDA device (torch.cuda.is_available() is False)"
    exit 0
fi

# what this machine lacks, from the carried wheels (no index: there is no internet)
for mod in pydantic pytest; do
    if ! "$PY" -c "import $mod" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --find-links benchmarks/wheels "$mod" \
            || { echo "gpu_check: $mod is missing and benchmarks/wheels has no wheel for it (make gpu-wheels)"; exit 1; }
    fi
done

# onnxfuse from this checkout without installing it: the package layout of pyproject.toml, as symlinks
PKG=$(mktemp -d)
trap 'rm -rf "$PKG"' EXIT
mkdir "$PKG/onnxfuse"
for f in onnxfuse/*; do ln -s "$ROOT/$f" "$PKG/onnxfuse/"; done
ln -s "$ROOT/training" "$PKG/onnxfuse/training"
ln -s "$ROOT/exporters" "$PKG/onnxfuse/exporters"
export PYTHONPATH="$PKG:$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import sys, numpy, onnx, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN",
      torch.backends.cudnn.version(), "| onnx", onnx.__version__, "| numpy", numpy.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "|", torch.cuda.device_count(), "device(s)")
EOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

echo "== tests marked cuda"
t0=$SECONDS
"$PY" -m pytest -q -s -p no:cacheprovider -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/tests.txt"
echo "tests: $((SECONDS - t0)) s"

echo "== benchmark"
t0=$SECONDS
"$PY" benchmarks/runtime_bench.py --device $DEVICE --models lenet,resnet18,transformer_lm --baselines vmap,hfta,dense "${BENCH_ARGS[@]}" \
    --budget-s "${BENCH_BUDGET_S:-300}" -o "$OUT"
echo "benchmark: $((SECONDS - t0)) s"
