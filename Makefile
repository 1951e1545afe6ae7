# liftoff: every target sets itself up; `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install run test lint bench clean

install: $(STAMP)

# torch first, from the CPU wheel: a looser spec would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/liftoff run $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) build artifacts outputs multirun .cache .pytest_cache .ruff_cache
