"""Zero-bubble schedules (zb-h1, zbv) train exactly like one process in every parallel layout,
and bit for bit like 1F1B / interleaved 1F1B with the same microbatch order."""

import pytest

from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout
from megatronish.testing.tiny_pipeline import tiny_pipeline_step

REFERENCE: dict[tuple, list] = {}
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32"]
ZB_H1 = ["parallel.pp=2", "parallel.pipeline_schedule=zb-h1"]
ZBV = ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zbv"]


def reference(arch: str, model: tuple[str, ...]) -> list:
    key = (arch, model)
    if key not in REFERENCE:
        REFERENCE[key] = [train_layout(0, 1, [f"model.arch={arch}", *model])]
    return REFERENCE[key]


# (arch, world, layout, model); strict p2p (a send completes only once received, as on NCCL)
# where no other feature needs the time. gpt2 ties its embedding and head: zbv puts both on
# rank 0, in different chunks, and sums their grads there.
CASES = {
    "zb-h1": ("llama", 2, ZB_H1, ("model.num_layers=4",)),
    "zbv-gpt2-tied": ("gpt2", 2, ZBV, ("model.num_layers=4",)),
    "zbv-pp4": (
        "llama",
        4,
        ["parallel.pp=4", "parallel.vpp=2", "parallel.pipeline_schedule=zbv"],
        ("model.num_layers=8",),
    ),
    "zb-h1-tp2-sp-full-recompute-qk-norm": (
        "llama",
        4,
        [*ZB_H1, "parallel.tp=2", "parallel.sp=true", "trainer.recompute=full"],
        ("model.num_layers=4", "model.qk_norm=true"),
    ),
    "zbv-gpt2-tp2-sp-selective-recompute": (
        "gpt2",
        4,
        [*ZBV, "parallel.tp=2", "parallel.sp=true", "trainer.recompute=selective"],
        ("model.num_layers=4",),
    ),
    "zbv-dp2-zero1": ("llama", 4, [*ZBV, "parallel.zero_stage=1"], ("model.num_layers=4",)),
    "zb-h1-dp2-zero2-moe-ep2": (
        "llama",
        4,
        [*ZB_H1, "parallel.zero_stage=2", "parallel.ep=2"],
        ("model.num_layers=4", *MOE),
    ),
    "zbv-dp2-zero3": ("llama", 4, [*ZBV, "parallel.zero_stage=3"], ("model.num_layers=4",)),
    "zbv-cp2": ("llama", 4, [*ZBV, "parallel.cp=2"], ("model.num_layers=4",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_bubble_matches_one_process(case):
    arch, world, layout, model = CASES[case]
    strict = case in ("zb-h1", "zbv-gpt2-tied", "zbv-pp4")
    got = run_world(
        train_layout,
        world,
        [f"model.arch={arch}", *model, *layout],
        strict_p2p=strict,
        timeout=300,
    )
    assert_parity(reference(arch, model), got)


@pytest.mark.parametrize(
    ("split", "plain"),
    [
        (ZB_H1, ["parallel.pp=2"]),
        (ZBV, ["parallel.pp=2", "parallel.vpp=2"]),  # interleaved 1F1B
    ],
    ids=["zb-h1-vs-1f1b", "zbv-vs-interleaved"],
)
def test_split_backward_is_bit_identical_to_the_whole_backward(split, plain):
    # Each weight's grads are the same products, accumulated over the microbatches in the same
    # order (W runs in microbatch order per chunk); only when they are computed moves. Without
    # clipping the updates follow the grads alone, so equal params after the steps mean equal
    # grads. The global norm sums each rank's squares and zbv places other chunks on each rank
    # than interleaved 1F1B, so it is equal to round-off (its bits depend on the CPU's vector
    # width); clipping would carry that round-off into the params.
    overrides = ["model.arch=gpt2", "model.num_layers=4", "optimizer.grad_clip=0"]
    zero_bubble = run_world(train_layout, 2, [*overrides, *split])
    whole = run_world(train_layout, 2, [*overrides, *plain])
    assert losses_of(zero_bubble) == losses_of(whole)  # the loss sits on another rank in a V
    for a, b in zip(zero_bubble, whole, strict=True):
        assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-6)
    left, right = merge_params(zero_bubble), merge_params(whole)
    assert left.keys() == right.keys()
    assert all(left[k].equal(right[k]) for k in left)


def _reductions_during(rank: int, world: int) -> list[str]:
    """The timeline op during which each data-parallel reduction of one zb-h1 step started,
    checked as it starts: past the first chunk a bucket's last grad arrives in a W (a B that
    computed the weight grads would leave its W nothing to run, which stops the step)."""
    import contextlib

    from megatronish.pipeline.engine import Timeline

    trainer = build_trainer(rank, world, [*ZB_H1, "parallel.zero_stage=2"], 1)
    zero, seen, running = trainer.zero, [], []
    launch = zero.launch_reduction

    def launched(bucket):
        op = running[-1] if running else "no op"
        assert rank == 0 or op.startswith("bwd_weight"), f"rank {rank} reduced during {op}"
        seen.append(op)
        return launch(bucket)

    trainer.timeline = timeline = Timeline()
    recorded = timeline.span

    @contextlib.contextmanager
    def span(name):
        running.append(name)
        try:
            with recorded(name):
                yield
        finally:
            running.pop()

    zero.launch_reduction, timeline.span = launched, span
    trainer.train_step()
    return seen


def test_zero_reduces_a_bucket_when_its_last_w_is_done():
    # ZeRO 2 reduces every bucket once per microbatch: with B deferring the weight grads, the
    # last grad of a bucket arrives in a W, never in a B; the first chunk (rank 0 here) runs its
    # whole backward in its B (its W is empty), so its buckets are reduced there.
    for rank, seen in enumerate(run_world(_reductions_during, 2)):
        kinds = {name.split(" ")[0] for name in seen}
        assert seen and kinds == ({"bwd_input"} if rank == 0 else {"bwd_weight"}), seen
        if rank == 0:
            assert all(name.endswith(" c0") for name in seen), seen


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_timeline_records_b_and_w_in_order_without_overlap(schedule):
    from collections import Counter

    from megatronish.pipeline.grouping import run_order, training_steps
    from megatronish.pipeline.schedule import compute_order

    vpp = 2 if schedule == "zbv" else 1
    name = lambda op: f"{op.kind} mb{op.microbatch} c{op.chunk}"
    for rank, events in enumerate(run_world(tiny_pipeline_step, 2, vpp, schedule)):
        events = sorted(events, key=lambda e: e[1])
        ops = run_order(training_steps(2, vpp, 4, rank, schedule))
        assert Counter(n for n, _, _ in events) == Counter(map(name, ops))  # every op, once
        computes = [n for n, _, _ in events if n.startswith(("fwd", "bwd"))]
        assert computes == [name(op) for op in compute_order(2, vpp, 4, rank, schedule)]
        for (_, _, end), (_, start, _) in zip(events, events[1:]):
            assert start >= end - 1e-9  # one thing at a time: a W is not inside a wait
