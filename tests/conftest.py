"""Shared fixtures: keep tests offline, quiet and single-threaded per rank."""

import os

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
