# Two commands do all the set-up on a fresh machine:
#   make demo   -- the main job
#   make test   -- the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench-plan clean etcd

# setup.py builds the optional compiled digest and delta (elastic_refit/transport/_digest.c, _delta.c).
$(STAMP): pyproject.toml setup.py elastic_refit/transport/_digest.c elastic_refit/transport/_delta.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 resolves to the local CPU build on CPU-only machines.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "installing etcd-server (needed by the integration tests)"; \
	  (apt-get update -q && apt-get install -y -q etcd-server) >/dev/null; }
	@command -v openssl >/dev/null 2>&1 || { \
	  echo "installing openssl (the secured-etcd tests make their certificates)"; \
	  (apt-get update -q && apt-get install -y -q openssl) >/dev/null; }

demo: $(STAMP) etcd
	$(BIN)/elastic-refit demo

# The pure unit tests on both cores, then the tests that start processes and etcd one at a time
# (their deadlines assume the machine is theirs).
test: $(STAMP) etcd
	$(BIN)/python -m pytest -q -n 2 --durations=10 tests/unit
	$(BIN)/python -m pytest -q --durations=25 tests --ignore=tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .

bench-plan: $(STAMP)
	$(BIN)/python benchmarks/bench_plan.py

clean:
	rm -rf $(VENV)
