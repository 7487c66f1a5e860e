# bertpipe: `make demo` runs the whole flow on CPU, `make test` runs the test suite.
# Both install what they need into .venv first (a fresh machine needs only Python 3.10+).
#
# GPU users: install your CUDA build of torch first, e.g.
#   make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM ?= false
export PIP_DISABLE_PIP_VERSION_CHECK = 1
# the environment's own tools (bertpipe, deepspeed, mlflow) first, activated or not
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install demo test test-fast test-multihost lint bench clean gpu-wheels gpu-check

install: $(VENV)/.installed

# torch goes in first: an unpinned torch (or deepspeed installed first) pulls a CUDA build
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet --constraint constraints.txt --editable ".[dev]"
	@# DeepSpeed's CPU communication op, compiled once here into TORCH_EXTENSIONS_DIR rather
	@# than by the first process that needs it (it takes ~25 s to ~1.5 min on 2 cores)
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
		|| echo "note: DeepSpeed's CPU op did not build now; the first run builds it"
	touch $@

demo: install
	$(BIN)/bertpipe demo --out runs/demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the suite on both cores (pytest-xdist), each worker computing on one thread (conftest.py);
# worksteal: an idle worker takes queued tests from the busy one (the minute-long multi-process
# tests otherwise left one core idle at the end: 11:00 against 8:10)
# (the tests with ranks on two test hosts, marked multihost, are part of it: they need root,
# iproute2, sshd and pdsh, which .ci/run installs, and skip with the reason without them)
# (--durations: CI's log shows where the suite's time goes)
# compileall first: where PYTHONDONTWRITEBYTECODE is set (the development VM sets it) no interpreter
# writes the bytecode it compiles, so each of the suite's ~270 child processes (ranks,
# launchers, workers) compiled the project's modules again; stale files are ignored by Python
test: lint
	$(BIN)/python -m compileall -q -j 0 bertpipe training finetuning preprocessing infra tests
	$(BIN)/pytest -n 2 --dist worksteal --durations=15

# only the tests with ranks on two test hosts: the four launch paths, the lost node at ZeRO 3
test-multihost: install
	$(BIN)/pytest -n 2 --dist worksteal -m multihost

test-fast: install
	$(BIN)/pytest -m "not integration and not slow"

bench: install
	$(BIN)/bertpipe bench preprocess

clean:
	rm -rf runs .cache .pytest_cache .ruff_cache

# GPU check (infra/gpu/README.md). gpu-wheels runs here (it needs PyPI): the wheels the GPU
# machine lacks, into .gpu-wheels/. gpu-check runs on the GPU machine, without network or
# .venv: it depends on no other target, and DeepSpeed must use CUDA there, not the cpu above.
OUT_DIR ?= runs/gpu-check

gpu-wheels: install
	PYTHON=$(CURDIR)/$(BIN)/python bash infra/gpu/wheels.sh

gpu-check:
	env -u DS_ACCELERATOR OUT_DIR="$(OUT_DIR)" bash infra/gpu/check.sh
