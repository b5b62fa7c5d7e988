# scaletrain: `make demo` runs the whole loop on the built-in corpus (sweep, fit, predict, train,
# check); `make test` runs the suite.
# Both create .venv if missing and install the project into it.

PYTHON ?= python3
# The PyTorch release installed into .venv; override: make demo TORCH='torch==2.11.*'.
# Plain `torch` without a pin pulls a multi-GB CUDA build. Where pip offers no CPU wheel of the
# pinned release, point it at PyTorch's CPU wheel index: make demo TORCH_PIP_ARGS='--index-url URL'.
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
VENV ?= .venv
BIN := $(VENV)/bin
# The install is redone when the torch spec or pyproject.toml changes.
STAMP := $(VENV)/.scaletrain-installed
STAMP_KEY := $(TORCH) $(TORCH_PIP_ARGS) $(shell cat pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)

DEMO_DIR ?= demo
# Test files run in this many worker processes (tests/conftest.py: each worker's torch threads,
# and the order the files are handed out in); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

.PHONY: install demo test clean

install:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if [ "$$(cat $(STAMP) 2>/dev/null)" != "$(STAMP_KEY)" ]; then \
		set -e; \
		echo "installing $(TORCH) and scaletrain into $(VENV)"; \
		$(BIN)/python -m pip install -q --upgrade pip; \
		$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"; \
		$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH)"; \
		echo "$(STAMP_KEY)" > $(STAMP); \
	fi

demo: install
	$(BIN)/scaletrain demo --out $(DEMO_DIR)
	$(BIN)/scaletrain generate $(DEMO_DIR)/final --prompt "$$(printf 'class Parser:\n    def __init__(self')" --max-new-tokens 120 --temperature 0.8 --top-k 50

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) data runs $(DEMO_DIR)
