# Two commands on a fresh machine: `make demo` (main job) and `make test` (the test suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean

$(STAMP): pyproject.toml requirements-lock.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-lock.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# Trains the debug model across a simulated 2 NVIDIA + 2 AMD cluster (pp=2 across vendors, dp=2 inside).
demo: $(STAMP)
	$(BIN)/bimetal train --config configs/demo.toml --simulate nvidia:2,amd:2

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check bimetal tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
