# onnxfuse: `make demo` and `make test` work on a fresh machine (Python 3.10-3.12, pip, gcc).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.onnxfuse-installed
# torch first, pinned: a plain range resolves to a multi-GB CUDA build on Linux; 2.13.0 here is a CPU build.
# Elsewhere, e.g.: make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# EXTRA=cpu: both runtimes (Python 3.10-3.12); EXTRA=torch: the torch runtime alone (any Python torch supports,
# e.g. make demo PYTHON=python3.13 EXTRA=torch TORCH=torch). The sweep extra (Ray, TensorBoard, Optuna) always.
TORCH  ?= torch==2.13.0
# torchvision for tests (tests/training/test_verify_sensitivity.py builds its regnet_x_400mf): the release made for that
# torch, installed with it so that pip keeps the torch above (TORCHVISION= leaves it out; that test then skips)
TORCHVISION ?= torchvision==0.28.0
EXTRA  ?= cpu

.PHONY: install demo test test-all test-isa fuzz bench clean gpu-wheels

$(BIN)/python:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v >= (3, 10) and ("$(EXTRA)" == "torch" or \
	  v <= (3, 12)) else "the ort runtime (EXTRA=$(EXTRA)) needs Python 3.10-3.12 (onnxruntime-training 1.19.2 has no " \
	  "wheels for %d.%d): set PYTHON=python3.11, or EXTRA=torch for the torch runtime alone" % v)'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH) $(TORCHVISION)
	$(BIN)/python -m pip install -q -e ".[$(EXTRA),sweep,dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/onnxfuse demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ""

# the numerical tests (marker "numerical": tests/conftest.py's NUMERICAL) with torch, oneDNN and MKL held to a lower
# instruction set than this CPU may have, one run per name in ISA: avx2, or default (SSE, torch's unvectorized
# kernels). ONNX Runtime picks its kernels by the CPU alone (no setting): its tests run as on the machine.
# The variables of each name are onnxfuse.runtime._machine's ISA_ENV (what `onnxfuse bench --isa` sets too).
ISA ?= avx2 default
ISA_ENV = $$($(BIN)/python -c 'import sys; from onnxfuse.runtime._machine import isa_env; \
	  print(" ".join(f"{k}={v}" for k, v in isa_env(sys.argv[1]).items()))' $(1))
test-isa: $(STAMP)
	@set -e; $(foreach isa,$(ISA),vars="$(call ISA_ENV,$(isa))"; echo "== numerical tests, $$vars:" \
	  "$$(env $$vars $(BIN)/python -c 'from onnxfuse.runtime._machine import cpu_description as d; print(d())')"; \
	  env $$vars $(BIN)/python -m pytest -q -m "numerical and not slow";)

# a differential fuzz campaign: N random models from seed SEED on, each fused at B = 1, 2, 3 (nodes in the form
# STRATEGY: default, grouped or per-model), trained on RUNTIME (ort, torch, loop: the array as a torch module in a plain loop, both or all) and compared with torch;
# COMPILE=on: the torch runtime's step compiled whole (make fuzz RUNTIME=torch COMPILE=on);
# PRECISION=bf16|fp16: trained under torch.autocast, each model against torch.autocast alone (torch; bf16 also loop)
N        ?= 500
SEED     ?= 1000
RUNTIME  ?= all
STRATEGY ?= default
COMPILE  ?= off
PRECISION ?= fp32
fuzz: $(STAMP)
	$(BIN)/python -m fuzz --n $(N) --seed $(SEED) --runtime $(RUNTIME) --strategy $(STRATEGY) --compile $(COMPILE) --precision $(PRECISION) --out fuzz-out

bench: $(STAMP)
	$(BIN)/python benchmarks/fused_vs_sequential.py

clean:
	rm -rf onnxfuse-demo build *.egg-info .pytest_cache fuzz-out

# Wheels benchmarks/gpu_check.sh installs on a GPU machine without internet (Python 3.12 there; PYVER= to change)
PYVER ?= 3.12
gpu-wheels:
	$(BIN)/python -m pip download -q --only-binary=:all: --python-version $(PYVER) --implementation cp \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d benchmarks/wheels "pydantic>=2.6,<3" "pytest>=8"
