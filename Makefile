# Two commands set everything up on a fresh machine:
#   make demo   - create .venv, install ckptctl; with a GPU, push the example checkpoint into the
#                 bundled stand-in server (examples/demo.py); without one, show the dry run
#   make test   - create .venv, install ckptctl with test extras, run the test suite
# (make docs regenerates docs/cli.md from the CLI's help; make completions the shell scripts)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint completions docs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Keep a torch that is already there; otherwise take 2.13.0 (the CPU build our machines carry).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

# The suite runs in parallel (pytest-xdist) and is bound by the CPU: every torchrun job imports
# torch in each of its processes. Six workers keep both cores busy while some tests wait on
# servers and sockets (four left a sixth of the CPU idle: 763 s of CPU in 456 s on 2 idle
# cores); --dist loadgroup keeps the GPU tests on one worker (tests/conftest.py).
TEST_WORKERS ?= 6
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=10

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

completions: setup
	$(BIN)/python completions/generate.py

docs: setup
	$(BIN)/python docs/generate_cli.py
