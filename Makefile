# Every target sets itself up on a fresh machine: `make test` creates .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2

.PHONY: venv test test-torch test-gpu-torch test-fakecuda test-gpucodegen test-extras test-slow test-gpu train format

venv: $(STAMP)

# torch is pinned and installed first: `torch==2.13.0` resolves to the CPU wheel here,
# and once it is installed the project's `torch>=2.13` needs nothing more (an unpinned
# torch would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

test: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

# The default suite under another torch: `make test-torch TORCH=2.11.0` (any 2.11-2.15).
# A separate venv per version, .venv-torch-$(TORCH). Those wheels come from the registry
# (CUDA builds of a few GB; they run on CPU); PIP_CONSTRAINT=/dev/null lifts this machine's
# global torch<=2.14.1 cap for that one command, and the project is then installed under a
# constraint that pins torch==$(TORCH), so pip cannot swap it.
TORCH ?=
TVENV := .venv-torch-$(TORCH)
TBIN := $(TVENV)/bin

$(TVENV)/.installed: pyproject.toml
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.11.0"; exit 2; }
	test -x $(TBIN)/python || $(PYTHON) -m venv $(TVENV)
	PIP_CONSTRAINT=/dev/null $(TBIN)/pip install torch==$(TORCH)
	echo torch==$(TORCH) > $(TVENV)/constraints.txt
	PIP_CONSTRAINT=$(TVENV)/constraints.txt $(TBIN)/pip install -e '.[dev]'
	touch $@

test-torch: $(TVENV)/.installed
	$(TBIN)/python -c "import torch; print('torch', torch.__version__)"
	$(TBIN)/python -m pytest -q

# The fake-CUDA lane (tests/fakecuda, docs/gpu.md): every CUDA path of the library on fake
# cuda tensors, under the CUDA build of torch 2.11 (the GPU machines' torch; it runs on a
# CPU without a driver). Its own venv, .venv-fakecuda (4.8 GB): torch and its CUDA
# libraries come from the registry one wheel at a time, at the pins of
# .ci/fakecuda-torch.txt, so the disk never holds the whole set of downloads beside the
# venv; the project goes in with that list as its constraint file, so pip cannot swap them.
FVENV := .venv-fakecuda
FBIN := $(FVENV)/bin
FPINS := .ci/fakecuda-torch.txt

$(FVENV)/.installed: pyproject.toml $(FPINS)
	test -x $(FBIN)/python || $(PYTHON) -m venv $(FVENV)
	for req in $$(grep -v '^#' $(FPINS)); do \
	  $(FBIN)/pip install --no-cache-dir --no-deps "$$req" || exit 1; done
	PIP_CONSTRAINT=$(FPINS) $(FBIN)/pip install -e '.[dev]'
	touch $@

# The default suite under the GPU machines' torch: the CUDA build of torch 2.11 in the
# fake-CUDA venv (it runs on a CPU without a driver), so CI runs every default test under
# 2.11 as well as under the pinned 2.13 without a venv of its own.
test-gpu-torch: $(FVENV)/.installed
	$(FBIN)/python -c "import torch; assert torch.__version__.startswith('2.11.'), torch.__version__; print('torch', torch.__version__)"
	$(FBIN)/python -m pytest -q

test-fakecuda: $(FVENV)/.installed
	$(FBIN)/python -c "import torch; assert torch.version.cuda, 'not a CUDA build'; print('torch', torch.__version__)"
	$(FBIN)/python -m pytest -m fakecuda tests/fakecuda -v -rf --tb=short

# The GPU-codegen lane (tests/gpucodegen, f8train/gpu_codegen.py), in the fake-CUDA venv:
# Inductor's forward and backward GPU code for one H100 / B200, every Triton kernel built
# for sm_90 / sm_100 (cubins for a subset of the recipes), no GPU; launch counts pinned.
test-gpucodegen: $(FVENV)/.installed
	OMP_NUM_THREADS=1 $(FBIN)/python -m pytest -m gpucodegen tests/gpucodegen -v -rf --tb=short

# The extras lane: the tests marked `extras` (torchao, transformers, torchtitan, accelerate,
# matplotlib) in a second venv, .venv-extras. torch==2.13.0 (the CPU wheel) is installed
# first and every later install runs under .ci/torch-pin.txt, so pip can never pull a CUDA
# build; the extras come at the versions in .ci/extras.txt. There a skip is a failure
# (FSDP_FLOAT8_EXTRAS_LANE=1, see tests/conftest.py).
EVENV := .venv-extras
EBIN := $(EVENV)/bin

$(EVENV)/.installed: pyproject.toml .ci/extras.txt .ci/torch-pin.txt
	test -x $(EBIN)/python || $(PYTHON) -m venv $(EVENV)
	PIP_CONSTRAINT=.ci/torch-pin.txt $(EBIN)/pip install torch==2.13.0
	PIP_CONSTRAINT=.ci/torch-pin.txt $(EBIN)/pip install -r .ci/extras.txt -e '.[dev]'
	touch $@

test-extras: $(EVENV)/.installed
	$(EBIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	FSDP_FLOAT8_EXTRAS_LANE=1 $(EBIN)/python -m pytest -q -m "extras and not gpu"

# pytest exits 5 when nothing is collected (no slow/gpu tests yet): not a failure here.
test-slow: venv
	$(BIN)/python -m pytest -q -m slow || [ $$? -eq 5 ]

# On a GPU machine, from the repository root, with that machine's torch: nothing is
# installed (docs/gpu.md). GPU_PYTHON picks the interpreter.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m pytest -q -m gpu tests/gpu || [ $$? -eq 5 ]

train: venv
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) -m f8train.train

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
