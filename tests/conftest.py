"""Shared fixtures: keep tests offline, quiet and single-threaded per rank."""

import os
import shutil
import tempfile

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# torch.testing.assert_close imports heavy modules on first use (~2 s). Pay that once in the
# parent so every forked test world inherits it.
import pytest  # noqa: E402
import torch  # noqa: E402

torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

# Single-process runs in the test process use one thread, like every forked rank: results do not
# depend on the thread count, and a busy machine does not stall multi-threaded kernels.
torch.set_num_threads(1)


def pytest_configure(config):
    """One folder of composed test configs for the session: the controller's, inherited by the
    pytest-xdist workers and every process they start (megatronish/testing/shared_configs.py)."""
    from megatronish.testing.shared_configs import FOLDER_ENV

    if not os.environ.get(FOLDER_ENV):
        os.environ[FOLDER_ENV] = config._megatronish_configs = tempfile.mkdtemp(
            prefix="megatronish-test-configs-"
        )


def pytest_unconfigure(config):
    folder = getattr(config, "_megatronish_configs", None)
    if folder is not None:  # made by this process
        shutil.rmtree(folder, ignore_errors=True)


# The fast tier (``make test-fast``): tests that start processes (forked gloo worlds, the entry
# point or torchrun in a subprocess, worker pools) are skipped at their first process start, and
# tests marked ``slow`` (several seconds in one process) are not run; everything else (pure
# functions, config, planner, single-process runs) runs. ``make test`` runs all of them. The
# guard is installed in the process that runs the tests (a pytest-xdist worker, not its
# controller, which starts the workers).
FAST_TIER = os.environ.get("MEGATRONISH_TESTS") == "fast"
FAST_TIER_REASON = "fast tier: this test starts processes (make test runs it)"


def pytest_collection_modifyitems(config, items):
    if not FAST_TIER:
        return
    slow = pytest.mark.skip(reason="fast tier: a multi-second test (make test runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(slow)


@pytest.fixture(scope="session")
def starts_processes():
    """For fixtures that prepare work for forked worlds: the fast tier skips before the
    preparation, not at the fork after it."""
    if FAST_TIER:
        pytest.skip(FAST_TIER_REASON)


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_skips_process_starts():
    if not FAST_TIER:
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        pytest.skip(FAST_TIER_REASON)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(os, "fork", refuse)
        yield


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory):
    """The small standard-library corpus of ``SMALL_STDLIB_RUN`` and its tokenizer, built once
    in the parent process (forked ranks and entry-point runs read it)."""
    from megatronish.config.compose import load_config
    from megatronish.data.build import build_datasets
    from megatronish.testing.runs import SMALL_STDLIB_RUN

    cache = tmp_path_factory.mktemp("corpus")
    cfg = load_config([*SMALL_STDLIB_RUN, f"data.cache_dir={cache}"])
    build_datasets(cfg.data, cfg.model.seq_length, cfg.trainer.seed)
    return cache


@pytest.fixture
def scalar_code_on_baseline_kernels():
    """Inductor's generated C++ under ``ATEN_CPU_CAPABILITY=default`` (``make test-kernels``):
    torch 2.13 still vectorizes it for this CPU, while the ATen vector headers it includes then
    define no vector types, and the code does not compile. Scalar code (``simdlen=1``) runs
    there; elsewhere inductor keeps its vectorized code."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "default":
        yield
        return
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.simdlen": 1}):
        yield
