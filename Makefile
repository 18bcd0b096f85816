# megatronish: `make train` runs the default job on this machine, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatronish-installed
# Multi-rank tests and CPU runs use one thread per rank; the default job uses every core.
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install train test bench mutants gpu-check lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	@touch $(STAMP)

# After training, a sample from the final checkpoint (the run's ARGS find it); SAMPLE= skips it.
SAMPLE ?= prompt='class Foo:' max_new_tokens=40
train: $(STAMP)
	$(PY) -m megatronish.train $(ARGS)
	$(if $(SAMPLE),$(PY) -m megatronish.generate $(ARGS) $(SAMPLE))

test: $(STAMP)
	WANDB_MODE=disabled $(PY) -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/bench/run_all.py $(ARGS)

# Deliberate bugs planted one at a time in a scratch copy: does a test catch each? (~3 min)
mutants: $(STAMP)
	$(PY) tools/mutants.py $(ARGS)

# One GPU, under 8 minutes: throughput vs plain PyTorch, flash attention, memory vs the planner,
# bit-exact resume, recompute policies -> docs/gpu.md. ARGS=--smoke: the same on the CPU, toy size.
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check megatronish tools tests
	$(PY) -m ruff format --check megatronish tools tests

format: $(STAMP)
	$(PY) -m ruff format megatronish tools tests
	$(PY) -m ruff check --fix megatronish tools tests

clean:
	rm -rf outputs .pytest_cache .ruff_cache
