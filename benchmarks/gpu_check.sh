#!/usr/bin/env bash
# The GPU check: the torch runtime on a CUDA device, in one short session on a machine without internet.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT if set, else gpu-check/)
#
# 1. the tests marked `cuda` (tests/, e.g. tests/test_cuda.py): fused training of zoo models on the GPU, eager and
#    compiled, equals each model trained alone by torch.optim on the same GPU; the compiled step tries a CUDA
#    graph and keeps it when faster, and its steps never synchronize (torch's sync debug mode);
# 2. a short `onnxfuse bench` with every mode that runs on CUDA (onnxfuse/measure/bench.py): the fused array on the
#    torch runtime, eager and compiled (torch-compiled), the same B models one after another in PyTorch
#    (seq-torch) and as B processes at once (concurrent), a torch.func (vmap) ensemble, the HFTA-style model fused
#    by hand, and one model at batch B*N (the ceiling), each peer eager and under torch.compile (mode "default"),
#    on LeNet, a small Transformer LM and ResNet-18. The ort modes run on the CPU only: left out with a note.
#    The bench's per-mode "first call s" is the compile time, cold (the script's compile cache starts empty).
# 3. mixed precision (`onnxfuse bench --precision fp32,bf16,fp16`): one model at one B, every mode but the compiled
#    peers in each precision, interleaved in the same rounds: the fused array eager and compiled with the torch
#    runtime's precision=, each peer's forward and loss under torch.autocast (fp16: GradScaler), and each mode's
#    peak memory per precision (the allocator's); to OUT_DIR/precision/. Its own compile cache, cold too.
#
# Sizes (environment): BENCH_MODELS (lenet,transformer_lm,resnet18), BENCH_B (16,64), BENCH_BUDGET_S (300: no
# new measurement starts after that many seconds; the compiled modes compile once per model and B, 10-60 s each);
# PRECISION_MODEL (transformer_lm), PRECISION_B (16), PRECISION_MODES (torch,torch-compiled,seq-torch,vmap,hfta,
# dense: three compiles of the fused step, about a minute and a half in all).
#
# Needs Python with torch built for CUDA, onnx, numpy, safetensors, pyyaml, tqdm, matplotlib, scikit-learn (newer
# versions are fine). What is missing is installed from benchmarks/wheels/ (pydantic, pytest; fetch them where
# there is internet with `make gpu-wheels`). onnxfuse itself is not installed: it is imported from this checkout
# (the package is the folder onnxfuse/ at its root).
# Everything goes to OUT_DIR: versions.txt, nvidia-smi.txt, tests.txt, bench.{md,json,csv,png},
# precision/bench.{md,json,csv,png}, log.txt.
# On a machine where torch sees no CUDA device it says so and exits 0. GPU_CHECK_DRY_RUN=1 runs the same steps on
# the CPU with tiny sizes, to test the script itself (its figures mean nothing): every mode, ort ones included, on
# LeNet alone at B = 2, one step per round, one round (about 2-4 min on a 2-core CPU with inductor's cache cold:
# four compiled modes compile LeNet), then the precision bench on LeNet at B = 2 (three more compiles).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT:-gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1

DEVICE=cuda MODELS=${BENCH_MODELS:-lenet,transformer_lm,resnet18}
BENCH_ARGS=(--B "${BENCH_B:-16,64}" --steps 10 --rounds 3 --budget-s "${BENCH_BUDGET_S:-300}")
PRECISION_MODEL=${PRECISION_MODEL:-transformer_lm}
PRECISION_ARGS=(--B "${PRECISION_B:-16}" --steps 10 --rounds 2 --warmup 2
                --modes "${PRECISION_MODES:-torch,torch-compiled,seq-torch,vmap,hfta,dense}")
if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
    DEVICE=cpu MODELS=lenet BENCH_ARGS=(--B 2 --steps 1 --rounds 1 --warmup 1)
    PRECISION_MODEL=lenet PRECISION_ARGS=(--B 2 --steps 1 --rounds 1 --warmup 1
                                          --modes torch,torch-compiled,seq-torch,vmap,hfta,dense)
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

# onnxfuse from this checkout without installing it; a fresh compile cache (onnxfuse's and inductor's), so that
# every compiled mode's first call is a cold compile
export PYTHONPATH="$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT
export ONNXFUSE_CACHE_DIR=$CACHE TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
"$PY" -c 'import onnxfuse.measure.bench' || { echo "gpu_check: onnxfuse does not import from $ROOT"; exit 1; }

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
# pytest exits 5 when it selects nothing to run (the dry run: no test marked cuda runs without CUDA)
"$PY" -m pytest -q -s -p no:cacheprovider -m cuda tests/ 2>&1 | tee "$OUT/tests.txt" || [ "${PIPESTATUS[0]}" = 5 ]
echo "tests: $((SECONDS - t0)) s"

echo "== benchmark"
t0=$SECONDS
# every mode (the default of --modes); the compiled peers use torch.compile's mode "default" on CUDA. The fused
# array's torch-compiled step tries a CUDA graph by itself (train_step.py: timed warm-up, capture, timed replays;
# kept when faster): its decision is in log.txt ("CUDA graph: step ... replayed vs ... launched"), and the tests
# marked cuda print it too ("CUDA graph: on|off").
"$PY" -m onnxfuse bench --device $DEVICE --models "$MODELS" "${BENCH_ARGS[@]}" -o "$OUT"
echo "benchmark: $((SECONDS - t0)) s"

echo "== mixed precision"
t0=$SECONDS
# every mode in fp32, bf16 and fp16 in the same interleaved rounds (ratios within one precision); a compile cache
# of its own, so that the fp32 fused step compiles cold here too
TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor-precision ONNXFUSE_CACHE_DIR=$CACHE/precision \
    "$PY" -m onnxfuse bench --device $DEVICE --models "$PRECISION_MODEL" "${PRECISION_ARGS[@]}" \
    --precision fp32,bf16,fp16 -o "$OUT/precision"
echo "mixed precision: $((SECONDS - t0)) s"
