# Every target sets itself up on a fresh machine: `make test` creates .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2

.PHONY: venv test test-slow test-gpu train format

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
	$(BIN)/python -m pytest -q

# pytest exits 5 when nothing is collected (no slow/gpu tests yet): not a failure here.
test-slow: venv
	$(BIN)/python -m pytest -q -m slow || [ $$? -eq 5 ]

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu || [ $$? -eq 5 ]

train: venv
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) -m scripts.train

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
