# megatronish: `make train` runs the default job on this machine, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatronish-installed
# Multi-rank tests and CPU runs use one thread per rank; the default job uses every core.
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install train test test-fast test-kernels bench mutants mutants-check gpu-check lint format clean \
	config-docs

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	@touch $(STAMP)

# After training, a sample from the final checkpoint (the run's ARGS find it); SAMPLE= skips it.
# Exit code 7 (the run in outputs/ is already complete) is not a failure here, and neither is 4,
# a graceful stop (a stop signal or trainer.exit_after_minutes; a checkpoint was saved and
# `make train` again resumes it): one line then, and no sample. A Ctrl-C in the terminal reaches
# make too, which ends with its own "Interrupt" once the trainer has saved.
SAMPLE ?= prompt='class Foo:' max_new_tokens=40
train: $(STAMP)
	@echo "$(PY) -m megatronish.train $(ARGS)"
	@$(PY) -m megatronish.train $(ARGS); code=$$?; \
	if [ $$code -eq 4 ]; then \
	  echo "make train: stopped with a checkpoint (exit 4); make train again resumes the run"; \
	  exit 0; \
	fi; \
	[ $$code -eq 0 ] || [ $$code -eq 7 ] || exit $$code; \
	$(if $(SAMPLE),echo "$(PY) -m megatronish.generate $(ARGS) $(SAMPLE)"; \
	  $(PY) -m megatronish.generate $(ARGS) $(SAMPLE))

# Two pytest-xdist workers (a file's tests run on one of them, sharing its module caches); most
# tests are one single-threaded process, so the second core would otherwise idle. More workers
# than cores would starve the multi-rank worlds; TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# The suite starts a few hundred Pythons (launch drills, entry points, CLIs). Compiled once here,
# they read megatronish's bytecode instead of compiling it each (~0.5 s per start), also where
# PYTHONDONTWRITEBYTECODE is set: that stops Python writing bytecode, not reading it.
BYTECODE := $(PY) -m compileall -q megatronish tools
test: $(STAMP)
	$(BYTECODE)
	WANDB_MODE=disabled $(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

# The inner loop (under 3 minutes): every test that starts no process (pure functions, config,
# planner, single-process runs); tests that fork worlds or run the entry point are skipped, and
# so are those marked slow (several seconds in one process: the largest planner sweeps).
test-fast: $(STAMP)
	$(BYTECODE)
	MEGATRONISH_TESTS=fast WANDB_MODE=disabled $(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

# Every command of README.md and docs/*.md as a user would type it, in a fresh copy of the tree
# after its own `make train` (tools/docs_check.py; ARGS=--list shows each command's class): the
# cheap ones run verbatim, long or multi-process training launches as dry runs.
.PHONY: docs-check
docs-check: $(STAMP)
	$(PY) tools/docs_check.py $(ARGS)

# The precision-sensitive tests (bf16, MoE routing, context parallel, the reference parity) again
# on torch's, oneDNN's and MKL's baseline kernels: a test that holds only on the instruction set
# of the machine it was written on fails here on any machine.
BASELINE_KERNELS := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
KERNEL_TESTS ?= tests/model/test_bf16.py tests/moe/test_moe.py tests/moe/test_moe_experts.py \
	tests/context_parallel/test_context_parallel.py tests/context_parallel/test_ring_attention.py \
	tests/context_parallel/test_a2a_ring.py tests/tensor_parallel/test_fp8.py \
	tests/training/test_reference_parity.py \
	tests/model/test_linear_cross_entropy.py tests/model/test_head_main_grad.py tests/model/test_rms_norm_kernel.py \
	tests/data_parallel/test_main_grad_accumulation.py tests/data_parallel/test_hybrid_shard.py
test-kernels: $(STAMP)
	$(BYTECODE)
	$(BASELINE_KERNELS) WANDB_MODE=disabled $(PY) -m pytest $(KERNEL_TESTS) $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/bench/run_all.py $(ARGS)

# Deliberate bugs planted one at a time in a scratch copy: does a test catch each? (~5 min)
mutants: $(STAMP)
	$(PY) tools/mutants.py $(ARGS)

# Seconds: every mutant still applies exactly once and names tests that exist (run by CI).
mutants-check: $(STAMP)
	$(PY) tools/mutants.py --check

# docs/config.md from the config schema, configs/ and the planner's and generate's options
# (tests/tools/test_config_reference.py fails while the page is stale).
config-docs: $(STAMP)
	$(PY) tools/config_reference.py

# One GPU, under 8 minutes: throughput vs plain PyTorch, flash attention, memory vs the planner,
# bit-exact resume, recompute policies, host syncs per step, MoE experts at 8 and 64, checkpoint
# save stall -> docs/gpu.md. ARGS=--smoke: the same on the CPU, toy size.
# The GPU machine has a Python with torch but no .venv, no Hydra and no network: there
# `PYTHON=python3 make gpu-check` (PYTHON given, or no .venv beside a wheelhouse) installs the
# wheelhouse of `make gpu-wheels` into a temporary directory, offline, and runs the check on that
# Python (scripts/gpu_env.sh). Elsewhere the check runs in .venv, installed first if need be.
# ARGS go to the check, e.g. ARGS="--sections documents,compiled --out $OUT/gpu.md": the report
# is rewritten after each section, so a run stopped at its time limit returns what it measured.
.PHONY: gpu-wheels gpu-env-check
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_PYTHON_GIVEN := $(filter environment command,$(origin PYTHON))
GPU_WHEELS_ONLY := $(if $(wildcard $(PY)),,$(wildcard $(GPU_WHEELS)/requirements.txt))
GPU_BARE := $(GPU_PYTHON_GIVEN)$(GPU_WHEELS_ONLY)
ifneq ($(GPU_BARE),)
gpu-check:
	PYTHON=$(PYTHON) GPU_WHEELS=$(GPU_WHEELS) bash scripts/gpu_env.sh $(ARGS)
else
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py $(ARGS)
endif

# Here, with network: the wheels the GPU machine lacks (CPython $(GPU_PYTHON_VERSION), manylinux
# x86_64, the .venv's versions) into $(GPU_WHEELS), which a GPU run carries with the tree.
gpu-wheels: $(STAMP)
	$(PY) tools/gpu_check/wheelhouse.py download --dest $(GPU_WHEELS) \
		--python-version $(GPU_PYTHON_VERSION)

# ~25 s of CPU (network for the wheels only): `make gpu-check`'s offline path, without network, in
# Pythons that see only the GPU machine's packages (.venv's torch & co.; no Hydra, wandb, datasets).
gpu-env-check: $(STAMP)
	$(if $(wildcard $(GPU_WHEELS)/requirements.txt),,$(MAKE) gpu-wheels)
	cd tools && $(abspath $(PY)) -m gpu_check.bare_python --wheelhouse $(abspath $(GPU_WHEELS))

lint: $(STAMP)
	$(PY) -m ruff check megatronish tools tests
	$(PY) -m ruff format --check megatronish tools tests

format: $(STAMP)
	$(PY) -m ruff format megatronish tools tests
	$(PY) -m ruff check --fix megatronish tools tests

clean:
	rm -rf outputs .pytest_cache .ruff_cache
