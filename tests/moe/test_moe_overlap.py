"""The shared experts' forward overlapped with the tokens' all-to-all
(``parallel.moe_shared_expert_overlap``): the order of posts, waits and the shared experts'
work recorded in real ranks, and the run bit-identical to the one without the overlap."""

import pytest
import torch

from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, train_layout

MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.shared_experts=1",
    "trainer.micro_batch_size=4",
]
ORDERS = {
    "ep2": (2, ["parallel.ep=2"]),
    "ep2-tp2-ep-first": (
        4,
        [
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.moe_dispatch_order=ep_first",
        ],
    ),
}


def _recorded_step(rank, world, overrides):
    """One training step's events of this rank, in order (each all-to-all of the dispatch
    module posted, ``sync`` or ``async``, and waited; each shared-experts forward begun and
    ended), and its block forwards (recompute off: one per block and microbatch)."""
    import megatronish.moe.dispatch as dispatch

    events: list[str] = []
    real = dispatch.all_to_all

    def recording(out, t, group, out_splits, in_splits, async_op=False):
        events.append("post-async" if async_op else "post-sync")
        work = real(out, t, group, out_splits, in_splits, async_op=async_op)
        if not async_op:
            return work
        wait = work.wait

        def recorded_wait():
            result = wait()
            events.append("wait")
            return result

        work.wait = recorded_wait
        return work

    dispatch.all_to_all = recording  # this forked rank only
    trainer = build_trainer(rank, world, [*MOE, *overrides], 1)
    for layer in trainer.moe_layers:
        layer.shared.register_forward_pre_hook(lambda *_: events.append("shared-start"))
        layer.shared.register_forward_hook(lambda *_: events.append("shared-end"))
    trainer.train_step()
    return events, len(trainer.moe_layers) * trainer.derived.num_microbatches


@pytest.mark.parametrize("name", list(ORDERS))
def test_the_shared_experts_run_while_the_tokens_travel(name):
    """With the overlap every block forward posts the rows' all-to-all, runs the shared experts,
    then waits for the rows; without it every all-to-all is waited as posted."""
    world, layout = ORDERS[name]
    for events, forwards in run_world(_recorded_step, world, layout):
        starts = [i for i, e in enumerate(events) if e == "shared-start"]
        assert len(starts) == forwards and events.count("post-async") == forwards
        for i in starts:
            assert events[i - 1 : i + 3] == ["post-async", "shared-start", "shared-end", "wait"]
    off = ["parallel.moe_shared_expert_overlap=false"]
    for events, forwards in run_world(_recorded_step, world, [*layout, *off]):
        assert "post-async" not in events and "wait" not in events
        assert events.count("shared-start") == forwards


def test_the_overlap_changes_nothing_in_the_numbers():
    world, layout = ORDERS["ep2-tp2-ep-first"]
    on = run_world(train_layout, world, [*MOE, *layout], 3)
    off = run_world(
        train_layout, world, [*MOE, *layout, "parallel.moe_shared_expert_overlap=false"], 3
    )
    for a, b in zip(on, off):
        assert a.losses == b.losses or (a.losses[0] != a.losses[0] and b.losses[0] != b.losses[0])
        assert a.grad_norms == b.grad_norms
        assert a.params.keys() == b.params.keys()
        assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
