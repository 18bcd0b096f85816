"""The session's shared composed configs: composed once, read back equal by every process."""

from omegaconf import OmegaConf

from megatronish.testing import shared_configs
from megatronish.testing.multiproc import run_world

OVERRIDES = ["+experiment=tiny", "parallel.tp=2", "trainer.max_steps=3"]


def _compose_counted(rank, world, folder):
    import os

    from megatronish.config import compose

    os.environ[shared_configs.FOLDER_ENV] = folder
    calls = []
    real = compose.load_config
    shared_configs.load_config = lambda o: calls.append(o) or real(o)
    cfg = shared_configs.composed(OVERRIDES)
    return len(calls), OmegaConf.to_container(cfg), OmegaConf.get_type(cfg).__name__


def test_the_ranks_of_a_world_compose_a_config_once_and_read_the_same(tmp_path, monkeypatch):
    results = run_world(_compose_counted, 3, str(tmp_path), init=False)
    assert sum(calls for calls, _, _ in results) == 1
    assert all(r[1:] == results[0][1:] for r in results)
    assert results[0][2] == "TrainConfig" and results[0][1]["parallel"]["tp"] == 2
    monkeypatch.delenv(shared_configs.FOLDER_ENV, raising=False)  # without it: composed anew
    calls = []
    monkeypatch.setattr(shared_configs, "load_config", calls.append)
    shared_configs.composed(OVERRIDES)
    shared_configs.composed(OVERRIDES)
    assert calls == [OVERRIDES, OVERRIDES]
