# Two commands on a fresh machine: `make demo` (main job) and `make test` (the test suite, lint first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Workers of the test suite (pytest-xdist; each test file runs on one worker). The tests start rank processes of
# their own, so more workers than cores only adds load: `make test TEST_JOBS=1` runs it serially.
TEST_JOBS ?= 2
# Debian packages some tests use: libibverbs1 (Mooncake's library links it even for TCP), iproute2 (the lab:
# ip, tc), iptables (the lab's link latency and packet loss on kernels without netem), slurm-wlm and munge (a
# private Slurm that tests/test_slurm_real.py starts and stops to run `bimetal slurm`'s scripts).
DEB_PACKAGES := libibverbs1 iproute2 iptables slurm-wlm munge

.PHONY: venv demo test lint debian-packages clean gpu-check docs

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

# Installs what is missing of DEB_PACKAGES when run as root on Debian/Ubuntu; otherwise says how, and the
# tests that need a missing package skip, naming it.
debian-packages:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing the Debian packages the tests use:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else \
	  echo "make: not installed:$$missing; the tests that need them skip (install: sudo apt-get update &&" \
	       "sudo apt-get install -y$$missing)"; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check bimetal tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) no interpreter writes bytecode,
# so every rank of every launched job would compile bimetal's modules again from source.
test: $(STAMP) debian-packages lint
	$(BIN)/python -m compileall -q bimetal tests scripts >/dev/null
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=10 tests

# docs/environment.md from bimetal/env.py's variable table (tests/test_docs.py holds the two equal).
docs: $(STAMP)
	$(BIN)/python scripts/env_page.py

# On a machine with one GPU: cpu-forward's GPU path right and fast, one table (scripts/gpu_check.sh; --cpu for CI).
gpu-check: $(STAMP)
	scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
