"""trainer.profile.steps=[a,b]: one Chrome trace per rank with ranges named after schedule ops."""

import json
import os

import pytest

from megatronish.config.validate import ConfigError, check_config
from megatronish.testing import runs
from megatronish.testing.multiproc import run_world
from megatronish.training.profiling import trace_path


def profiled_run(rank, world, overrides, steps, profile_dir):
    trainer = runs.build_trainer(
        rank, world, [*overrides, f"trainer.profile.dir={profile_dir}"], steps
    )
    trainer.fit()
    return trainer.timers.ranges


def range_names(path: str) -> set[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return {e["name"] for e in events if e.get("ph") == "X"}


def test_pipeline_profile_writes_a_trace_per_rank_with_named_ranges(tmp_path):
    layout = ["parallel.pp=2", "parallel.zero_stage=1", "trainer.profile.steps=[2,3]"]
    ranges_left_on = run_world(profiled_run, 2, layout, 4, str(tmp_path), timeout=180)
    assert ranges_left_on == [False, False]
    assert sorted(os.listdir(tmp_path)) == ["rank00000.json", "rank00001.json"]
    for rank in (0, 1):
        names = range_names(trace_path(str(tmp_path), rank))
        # pp=2, vpp=1: rank r runs chunk r of each microbatch (4 microbatches per step); dp = 1
        # gathers no params.
        expected = {
            "step 2",
            "step 3",
            f"forward mb0 chunk{rank}",
            f"forward mb3 chunk{rank}",
            f"backward mb0 chunk{rank}",
            "optimizer",
            "grad reduction wait",
            "reduce-scatter grads",
            "data",
        }
        expected.add("send act mb0 chunk0" if rank == 0 else "recv act mb0 chunk1")
        expected.add("recv grad mb0 chunk0" if rank == 0 else "send grad mb0 chunk1")
        assert expected <= names, expected - names
        assert "step 1" not in names and "step 4" not in names
        assert any(n.startswith("aten::") for n in names)  # the ops under the ranges


def test_profile_stops_and_is_written_when_training_ends_inside_the_range(tmp_path):
    run_world(profiled_run, 1, ["trainer.profile.steps=[2,5]"], 2, str(tmp_path))
    names = range_names(trace_path(str(tmp_path), 0))
    assert {"step 2", "forward mb0 chunk0", "backward mb3 chunk0", "optimizer"} <= names
    assert "step 1" not in names


def test_no_profile_without_steps(tmp_path):
    run_world(profiled_run, 1, [], 1, str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("steps", ["[3,2]", "[0,2]", "[4]"])
def test_bad_profile_steps_are_one_clear_error(steps):
    with pytest.raises(ConfigError, match=r"trainer.profile.steps=.* must be \[first, last\]"):
        check_config(runs.test_config([f"trainer.profile.steps={steps}"], 4), 1)
