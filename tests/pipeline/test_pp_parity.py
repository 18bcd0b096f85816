"""Pipeline parallelism (1F1B and interleaved) alone and with tp/sp/dp equals one process."""

from collections import Counter

import pytest

from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, train_layout
from megatronish.testing.tiny_pipeline import tiny_pipeline_step

REFERENCE: dict[tuple, list] = {}


def reference(arch, layers):
    key = (arch, layers)
    if key not in REFERENCE:
        REFERENCE[key] = [train_layout(0, 1, [f"model.arch={arch}", f"model.num_layers={layers}"])]
    return REFERENCE[key]


CASES = [
    (2, ["parallel.pp=2"], 4),
    (2, ["parallel.pp=2", "parallel.vpp=2"], 4),
    (4, ["parallel.pp=4"], 4),
    (4, ["parallel.pp=4", "parallel.vpp=2"], 8),
    (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=2", "parallel.sp=true"], 4),
    (4, ["parallel.pp=2", "parallel.vpp=2"], 4),  # with dp=2
    (8, ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=2", "parallel.sp=true"], 4),  # 3D
]


# gpt2 (embedding and head tied across the first and last stage) runs the cases that move the
# tied pair: two stages, four interleaved, with tp/sp, with dp. Its 3D layout runs in test_zero.
GPT2_CASES = [CASES[0], CASES[3], CASES[4], CASES[5]]
ARCH_CASES = [("llama", *c) for c in CASES] + [("gpt2", *c) for c in GPT2_CASES]


@pytest.mark.parametrize("arch,world,layout,layers", ARCH_CASES)
def test_pipeline_matches_serial(arch, world, layout, layers):
    # llama runs with a send completing only once the peer received it, as on NCCL.
    got = run_world(
        train_layout,
        world,
        [f"model.arch={arch}", f"model.num_layers={layers}", *layout],
        strict_p2p=arch == "llama",
        timeout=300,
    )
    assert_parity(reference(arch, layers), got)


def _one_step(rank, world, vpp):
    return sorted(tiny_pipeline_step(rank, world, vpp), key=lambda e: e[1])


def test_timeline_records_every_op_in_the_order_it_runs():
    from megatronish.pipeline.grouping import run_order, training_steps
    from megatronish.pipeline.schedule import schedule_ops

    for rank, events in enumerate(run_world(_one_step, 2, 2)):
        ops = run_order(training_steps(2, 2, 4, rank))
        assert [n for n, _, _ in events] == [
            f"{op.kind} mb{op.microbatch} c{op.chunk}" for op in ops
        ]
        for (_, _, end), (_, start, _) in zip(events, events[1:]):
            assert start >= end - 1e-9  # one thing at a time: a wait is not inside a compute
        assert Counter(ops) == Counter(schedule_ops(2, 2, 4, rank))  # every op, once


def test_uneven_layer_split_matches_serial():
    got = run_world(train_layout, 2, ["parallel.pp=2", "parallel.pipeline_layer_split=[1,3]"])
    assert_parity(reference("llama", 4), got)


def _freed(rank, world):
    import megatronish.pipeline.engine as engine

    freed = []
    original = engine._free_data

    def spy(t):
        original(t)
        freed.append(t.untyped_storage().nbytes())

    engine._free_data = spy
    trainer = build_trainer(rank, world, ["parallel.pp=2"], 1)
    trainer.train_step()
    return freed


def test_outputs_are_freed_after_sending():
    first, last = run_world(_freed, 2)
    assert len(first) == 4 and all(n <= 4 for n in first)  # 4 microbatches sent, 1 float kept
    assert last == []  # the last stage sends grads, not outputs
