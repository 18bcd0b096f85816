"""One training step moves exactly the analytic tensor/sequence-parallel volume."""

import pytest

from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import TINY_TEST_MODEL, train_layout


def setting(key):
    return int(next(a.split("=")[1] for a in TINY_TEST_MODEL if a.startswith(key + "=")))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("sp", [False, True])
def test_tp_step_moves_the_analytic_volume(arch, sp):
    tp, micro = 2, 2
    mbs = setting("trainer.micro_batch_size")
    layers, h, s = setting("model.num_layers"), setting("model.hidden_size"), 16
    results = run_world(
        train_layout,
        tp,
        [
            f"model.arch={arch}",
            f"parallel.tp={tp}",
            f"parallel.sp={str(sp).lower()}",
            f"trainer.global_batch_size={micro * mbs}",
        ],
        1,
    )
    stats = results[0].stats
    sbh = s * mbs * h * 4  # bytes of one full [s, b, h] fp32 activation
    ce = 3 * s * mbs * 4  # max, target logit and sum of exp: three [s, b] all-reduces
    if not sp:
        # Per layer: 2 forward all-reduces (attention out, fc2) + 2 backward (qkv, fc1 inputs);
        # embedding forward + head-input backward; the cross-entropy's three.
        expected = {
            "tp/all_reduce": {
                "calls": micro * (4 * layers + 2 + 3),
                "bytes": micro * ((4 * layers + 2) * sbh + ce),
            }
        }
    else:
        # Per layer: 2 all-gathers + 2 reduce-scatters forward, mirrored backward; embedding
        # reduce-scatter (fwd) / all-gather (bwd); head gather (fwd) / reduce-scatter (bwd).
        n = 4 * layers + 2
        # Replicated params fed by sequence shards get one flat grad all-reduce per step:
        # llama: norm weights; gpt2: norm weights and biases, row-parallel biases, positions.
        if arch == "llama":
            replicated = (2 * layers + 1) * h
        else:
            replicated = (2 * layers + 1) * 2 * h + 2 * layers * h + s * h
        sp_grads = replicated * 4
        expected = {
            "tp/all_gather": {"calls": micro * n, "bytes": micro * n * sbh},
            "tp/reduce_scatter": {"calls": micro * n, "bytes": micro * n * sbh},
            "tp/all_reduce": {"calls": micro * 3 + 1, "bytes": micro * ce + sp_grads},
        }
    got = {k: v for k, v in stats.items() if k.startswith("tp/")}
    assert got == expected


@pytest.mark.parametrize(
    "tp,recompute,precision",
    [(1, "none", "fp32"), (1, "full", "fp32"), (2, "none", "fp32"), (1, "none", "bf16")],
)
def test_cp_step_moves_the_analytic_volume(tp, recompute, precision):
    """Per layer and microbatch: one all-gather of k|v over cp in forward (again when full
    recompute reruns the forward) and one reduce-scatter of their grads in backward, each of the
    whole sequence's ``[s, b, 2 * kv_heads / tp, d]`` (bf16 runs: bf16 on the wire); grads
    reduced over dp x cp like dp's."""
    cp, micro = 2, 2
    mbs = setting("trainer.micro_batch_size")
    layers, h, s = setting("model.num_layers"), setting("model.hidden_size"), 16
    heads, kv = setting("model.num_attention_heads"), setting("model.num_query_groups")
    common = [
        f"trainer.global_batch_size={micro * mbs}",
        f"parallel.tp={tp}",
        f"trainer.recompute={recompute}",
        f"trainer.precision={precision}",
    ]
    got = run_world(train_layout, tp * cp, [*common, f"parallel.cp={cp}"], 1)[0].stats
    kv_bytes = s * mbs * (2 * kv // tp) * (h // heads) * (2 if precision == "bf16" else 4)
    forwards = 2 if recompute == "full" else 1
    assert got["cp/all_gather"] == {
        "calls": forwards * micro * layers,
        "bytes": forwards * micro * layers * kv_bytes,
    }
    assert got["cp/reduce_scatter"] == {"calls": micro * layers, "bytes": micro * layers * kv_bytes}
    if tp == 1:  # the same buckets as plain data parallelism over as many ranks
        dp = run_world(train_layout, cp, [*common, f"parallel.dp={cp}"], 1)[0].stats
        assert got["dp_cp/all_reduce"] == dp["dp/all_reduce"]
