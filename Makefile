# zeroqueue: `make serve` runs the service on the bundled model; `make test` installs everything and runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# a checkpoint directory for `make serve`; empty: the bundled model (zq-python-tiny), serve's default
MODEL ?=
ZEROQUEUE_HOME ?= $(HOME)/.zeroqueue
export ZEROQUEUE_HOME

.PHONY: install install-dev kernels protos check-protos serve lint format test test-fast lint-deploy gpu-wheels client-wheel clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

# grpc-js client for the cross-implementation test
tests/node/node_modules/.installed: tests/node/package.json tests/node/package-lock.json
	cd tests/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed kernels
install-dev: $(VENV)/.installed-dev kernels tests/node/node_modules/.installed

# Compiles the CPU kernels once, for this CPU's ISA (AVX-512 or AVX2; about a minute); the engine falls
# back to plain torch when they are missing.
kernels: $(VENV)/.installed
	$(PY) -m services.inference.device.kernels build

# The one command that generates the protobuf and gRPC code.
protos: $(VENV)/.installed-dev
	$(PY) -m grpc_tools.protoc -I protos -I $$($(PY) -c "import grpc_tools, os; print(os.path.dirname(grpc_tools.__file__))")/_proto \
	  --python_out=protos --grpc_python_out=protos --pyi_out=protos \
	  $$(cd protos && find zeroqueue -name '*.proto' | sort)

check-protos: $(VENV)/.installed-dev
	$(PY) -m tests.tools.check_protos

# First run: creates the embedded SQLite ledger and a demo tenant, and prints the tenant's API key once.
serve: install
	$(VENV)/bin/zeroqueue migrate
	$(VENV)/bin/zeroqueue serve $(if $(MODEL),--model $(MODEL)) --demo-tenant demo --metrics-port 9464 --http-port 8000

# ruff: the linter and the formatter (pyproject.toml [tool.ruff]); `make format` applies the formatter
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: install-dev lint
	$(PY) -m pytest -q

test-fast: install-dev
	$(PY) -m pytest -q -m "not slow"

# The deploy/ checks alone (they are also part of `make test`): hadolint on the Dockerfile, the Kubernetes
# manifests against the schemas (offline), the dashboard's queries against the exported metrics.
lint-deploy: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m "not slow" tests/deploy

# The packages a lent H200 lacks (bench/gpu_wheels.txt) as wheels in .whl/, for bench/gpu_run.sh; needs PyPI.
gpu-wheels:
	bash bench/gpu_wheels.sh

# The client distribution (services/client/distribution): the SDK as `zeroqueue.client` and the generated stubs,
# a wheel in dist/ that needs grpcio and protobuf, not torch or the server. Its build/ is cleared first, so a
# module removed from services/client cannot linger in the wheel.
client-wheel: $(VENV)/.installed
	rm -rf build/zeroqueue-client
	$(PIP) wheel -q --no-deps --no-build-isolation -w dist/ services/client/distribution

clean:
	rm -rf $(VENV) build *.egg-info services/inference/device/kernels/_build
