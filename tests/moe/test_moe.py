"""Mixture of experts: routing, dispatch and combine, the block against a per-token reference,
the auxiliary losses in the gradient, and expert parallelism composed with every other dimension
equal to one process (fp32, gloo)."""

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronish.config.validate import config_errors
from megatronish.distributed.comm import ParallelGroup
from megatronish.distributed.parallel_grid import GROUP_NAMES, ParallelGrid
from megatronish.generate.decode import new_cache
from megatronish.model.blocks import moe_layer
from megatronish.model.gpt import GPTChunk
from megatronish.model.init import init_parameters
from megatronish.model.parallel_context import ParallelContext
from megatronish.moe import metrics as moe_metrics
from megatronish.moe.dispatch import combine, dispatch, expert_major
from megatronish.moe.routing import (
    expert_capacity,
    load_balancing_loss,
    route,
    sort_assignments,
    z_loss,
)
from megatronish.spec import ModelSpec, MoESpec
from megatronish.testing.compare import assert_parity, max_relative_loss_gap
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, train_layout
from megatronish.testing.runs import test_config as tiny_config

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.router.z_loss_coef=0.001"]
STEPS = 4
_REF: dict[str, list] = {}


def reference(mbs: int, extra: tuple[str, ...] = ()) -> list:
    key = f"{mbs} {extra}"
    if key not in _REF:
        args = [f"trainer.micro_batch_size={mbs}", *MOE, *extra]
        _REF[key] = [train_layout(0, 1, args, STEPS)]
    return _REF[key]


def spec_of(arch="llama", experts=4, top_k=2, shared=0, capacity=None, aux=0.01, z=1e-3):
    moe = MoESpec(
        num_experts=experts,
        top_k=top_k,
        layer_freq=1,
        ffn_hidden_size=24,
        shared_experts=shared,
        capacity_factor=capacity,
        aux_loss_coef=aux,
        z_loss_coef=z,
    )
    return ModelSpec(
        arch=arch,
        num_layers=2,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=2,
        ffn_hidden_size=32,
        seq_length=8,
        vocab_size=64,
        padded_vocab_size=128,
        max_position_embeddings=8,
        moe=moe,
    )


# -- routing (pure) -------------------------------------------------------------------------
def test_ties_go_to_the_lower_expert_and_weights_renormalise():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 2.0]])
    probs, weights, experts = route(logits, top_k=2)
    assert experts.tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    _, raw, _ = route(logits, top_k=2, renormalize=False)
    torch.testing.assert_close(raw[1], torch.softmax(logits[1], -1)[[1, 2]])


def test_dropless_order_groups_by_expert_in_token_order():
    experts = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, counts, dropped = sort_assignments(experts, torch.ones(3, 2), 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4] and counts.tolist() == [2, 2, 2, 0]
    assert int(dropped) == 0


def test_capacity_keeps_each_experts_heaviest_slots():
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    # expert 0 is offered tokens 0 (0.6), 1 (0.9), 2 (0.5), 3 (0.3): capacity 2 keeps 1 and 0.
    order, counts, dropped = sort_assignments(experts, weights, 3, capacity=2)
    assert order.tolist()[:5] == [0, 2, 1, 6, 5]  # expert 0: t0, t1; expert 1: t0, t3; expert 2: t2
    assert order.tolist()[5:] == [3, 4, 7]  # the dropped ones last, in token order
    assert counts.tolist() == [2, 2, 1] and int(dropped) == 3
    assert expert_capacity(tokens=4, num_experts=3, top_k=2, factor=1.0) == 3


def test_expert_major_regroups_chunks():
    counts = torch.tensor([[1, 2], [3, 0]])  # source 0: e0 x1, e1 x2; source 1: e0 x3
    # source-major rows: [s0e0 | s0e1 s0e1 | s1e0 s1e0 s1e0]; expert-major: e0 (s0, s1), e1.
    assert expert_major(counts).tolist() == [0, 3, 4, 5, 1, 2]


def test_auxiliary_losses_follow_their_formulas():
    torch.manual_seed(0)
    logits = torch.randn(6, 4)
    probs, _, experts = route(logits, 2)
    counts = torch.bincount(experts.flatten(), minlength=4)
    want = 0.1 * sum(probs[:, e].mean() * counts[e] / (6 * 2) for e in range(4)) * 4
    torch.testing.assert_close(load_balancing_loss(probs, counts, 6, 2, 0.1), want)
    # Parts of a sequence add up to the whole.
    halves = sum(load_balancing_loss(probs[i : i + 3], counts, 6, 2, 0.1) for i in (0, 3))
    torch.testing.assert_close(halves, want)
    lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(z_loss(logits, 6, 0.01), 0.01 * (lse**2).mean())


# -- the block against a per-token reference (one process) ----------------------------------
def naive_moe(layer, x, capacity=None):
    """Loop over tokens and slots: ``sum_k w_k expert_k(x)`` (+ shared), with the layer's
    weights; capacity drops the lowest weights per expert, as documented."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.t()
    probs = torch.softmax(logits, -1)
    weights, experts = probs.topk(layer.moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    keep = torch.ones_like(weights, dtype=torch.bool)
    if capacity is not None:
        for e in range(layer.moe.num_experts):
            slots = [
                (-float(weights[t, k].detach()), t, k)
                for t in range(len(tokens))
                for k in range(layer.moe.top_k)
                if experts[t, k] == e
            ]
            for _, t, k in sorted(slots)[capacity:]:
                keep[t, k] = False
    rows = []
    for t in range(len(tokens)):
        y = torch.zeros_like(tokens[t])
        for k in range(layer.moe.top_k):
            if keep[t, k]:
                e = int(experts[t, k])
                h = layer.experts.fc1[e] @ tokens[t]
                if layer.experts.llama:
                    gate, up = h.chunk(2)
                    h = F.silu(gate) * up
                else:
                    h = F.gelu(h, approximate="tanh")
                y = y + weights[t, k] * (layer.experts.fc2[e] @ h)
        rows.append(y)
    out = torch.stack(rows).view_as(x)
    return out if layer.shared is None else out + layer.shared(x)


def built(spec):
    layer = moe_layer(spec, ParallelContext())
    init_parameters(layer, 7, 0, 1)
    return layer


@pytest.mark.parametrize(
    "arch, shared, capacity", [("llama", 0, None), ("gpt2", 1, None), ("llama", 1, 1.0)]
)
def test_block_equals_per_token_reference(arch, shared, capacity):
    torch.manual_seed(1)
    layer = built(spec_of(arch, shared=shared, capacity=capacity, aux=0.0, z=0.0))
    x = torch.randn(8, 2, 16, requires_grad=True)
    g = torch.randn(8, 2, 16)
    layer(x).backward(g)
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    cap = None if capacity is None else expert_capacity(16, 4, 2, capacity)
    naive_moe(layer, x, cap).backward(g)
    want = [x.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if capacity is not None:
        assert layer.stats[-1] > 0  # some slots were over capacity


def test_balancing_and_z_losses_are_in_the_gradient():
    """The router's grad is that of ``<out, g> + scale * (aux + z)`` written out by hand."""
    torch.manual_seed(2)
    aux_coef, z_coef, scale = 0.3, 0.05, 0.5
    layer = built(spec_of(aux=aux_coef, z=z_coef))
    layer.loss_scale = scale
    x = torch.randn(8, 2, 16)
    g = torch.randn(8, 2, 16)
    without = naive_router_grad(layer, x, g)
    layer(x).backward(g)
    got = layer.router.grad.clone()
    layer.zero_grad()
    out = naive_moe(layer, x)
    logits = x.reshape(-1, 16) @ layer.router.t()
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(probs.topk(2, -1).indices.flatten(), minlength=4).float()
    fraction, mean_prob = counts / (16 * 2), probs.mean(0)
    aux = aux_coef * 4 * (fraction * mean_prob).sum()
    zl = z_coef * torch.logsumexp(logits, -1).square().mean()
    ((out * g).sum() + scale * (aux + zl)).backward()
    torch.testing.assert_close(got, layer.router.grad, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(got, without, rtol=1e-3, atol=1e-5)  # the losses do count
    stats = layer.stats
    assert stats[:4].sum() == 16 * 2  # every token's two slots
    assert math.isclose(float(stats[-3]), float(aux.detach()), rel_tol=1e-5)
    assert math.isclose(float(stats[-2]), float(zl.detach()), rel_tol=1e-5)


def naive_router_grad(layer, x, g):
    """The router's grad without the auxiliary losses."""
    layer.zero_grad()
    (naive_moe(layer, x) * g).sum().backward()
    grad = layer.router.grad.clone()
    layer.zero_grad()
    return grad


# -- dispatch over ep ranks -----------------------------------------------------------------
def _round_trip(rank, world):
    group = ParallelGroup("ep", tuple(range(world)), rank, pg=dist.group.WORLD)
    gen = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randn(12, 5, generator=gen)
    experts = torch.randint(0, 2 * world, (12, 1), generator=gen)
    order, counts, _ = sort_assignments(experts, torch.ones(12, 1), 2 * world)
    rows, record = dispatch(tokens, order, counts, 1, group)
    back = combine(rows, record, torch.ones(12, 1), group)
    return tokens, experts, rows, record.local_counts, back


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_delivers_every_token_to_its_expert_and_combine_restores_order(world):
    results = run_world(_round_trip, world)
    for rank, (tokens, _, _, _, back) in enumerate(results):
        assert torch.equal(back, tokens), rank  # bit-identical, original order
    for rank, (_, _, rows, local_counts, _) in enumerate(results):
        want = []
        for e in (2 * rank, 2 * rank + 1):  # this rank's experts, each from every source
            for tokens, experts, *_ in results:
                want.append(tokens[experts[:, 0] == e])
        assert torch.equal(rows, torch.cat(want)), rank
        assert sum(local_counts) == rows.shape[0]


def _ep_first_round_trip(rank, world):
    """tp=2 x ep=2 in Megatron's order (ranks 2 ep + tp): each tp rank sends its own tokens over
    ep, then the rows are gathered over tp; each uneven gather's sizes are held to what every
    member holds, as NCCL needs (gloo would move the wrong rows without a word)."""
    import megatronish.moe.dispatch as dispatch_module
    from megatronish.moe.dispatch import dispatch_ep_first

    def gather_checked(t, group, sizes):
        rows = [torch.zeros(1, dtype=torch.long) for _ in range(group.size)]
        dist.all_gather(rows, torch.tensor([t.shape[0]]), group=group.handle())
        held = [int(r) for r in rows]
        assert list(sizes) == held, f"gathering {list(sizes)} rows of members holding {held}"
        return gather(t, group, sizes)

    gather, dispatch_module.all_gather_uneven = dispatch_module.all_gather_uneven, gather_checked
    handles = {ranks: dist.new_group(list(ranks)) for ranks in [(0, 1), (2, 3), (0, 2), (1, 3)]}
    tp_ranks, ep_ranks = (rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2)
    tp = ParallelGroup("tp", tp_ranks, rank % 2, pg=handles[tp_ranks])
    ep = ParallelGroup("ep", ep_ranks, rank // 2, pg=handles[ep_ranks])
    gen = torch.Generator().manual_seed(20 + rank)
    tokens = torch.randn(12, 5, generator=gen)
    experts = torch.randint(0, 4, (12, 1), generator=gen)
    order, counts, _ = sort_assignments(experts, torch.ones(12, 1), 4)
    rows, record, _ = dispatch_ep_first(tokens, order, counts, 1, ep, tp)
    back = combine(rows / tp.size, record, torch.ones(12, 1), ep)  # partial over tp: summed
    return tokens, experts, rows, record.tp_sizes, back


def test_ep_first_dispatch_gathers_every_tp_ranks_rows_and_combine_sums_them_back():
    results = run_world(_ep_first_round_trip, 4)
    for rank, (tokens, _, _, _, back) in enumerate(results):
        assert torch.equal(back, tokens), rank
    assert any(len(set(tp_sizes)) > 1 for *_, tp_sizes, _ in results)  # uneven gathers
    for rank, (_, _, rows, _, _) in enumerate(results):
        want = []
        for e in (2 * (rank // 2), 2 * (rank // 2) + 1):  # this ep rank's experts
            for source in (0, 2, 1, 3):  # tp rank-major, then ep rank: ranks 0, 2, 1, 3
                tokens, experts, *_ = results[source]
                want.append(tokens[experts[:, 0] == e])
        assert torch.equal(rows, torch.cat(want)), rank


# -- groups ---------------------------------------------------------------------------------
def test_ep_is_carved_out_of_dp_times_cp():
    tp, cp, dp, pp, ep = 2, 2, 2, 2, 2
    grid = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    groups = {name: grid.groups(name) for name in GROUP_NAMES}
    for name in ("ep", "edp"):
        assert sorted(r for g in groups[name] for r in g) == list(range(16))
    for dpcp in groups["dp_cp"]:  # each dp x cp group splits into ep x edp
        mine = [g for g in groups["ep"] if set(g) <= set(dpcp)]
        assert len(mine) == len(dpcp) // ep and all(len(g) == ep for g in mine)
    rank = grid.dense.rank(tp=1, cp=1, dp=1, pp=0)
    ep_rank, edp_rank = grid.expert.coords(rank)["ep"], grid.expert.coords(rank)["edp"]
    assert (ep_rank, edp_rank) == (1, 1)
    assert [g for g in groups["ep"] if rank in g][0].index(rank) == ep_rank


# -- training: expert parallelism composed, equal to one process ----------------------------
EP_FIRST = "parallel.moe_dispatch_order=ep_first"
LAYOUTS = {
    "ep2": (2, 4, ["parallel.ep=2"], ()),
    "ep4": (4, 2, ["parallel.ep=4"], ()),
    "ep2-gpt2": (2, 4, ["parallel.ep=2"], ("model.arch=gpt2",)),
    "ep2-dp4-zero0": (4, 2, ["parallel.ep=2"], ()),
    "ep2-dp4-zero1": (4, 2, ["parallel.ep=2", "parallel.zero_stage=1"], ()),
    "ep2-dp4-zero2": (4, 2, ["parallel.ep=2", "parallel.zero_stage=2"], ()),
    "ep2-dp4-zero3": (4, 2, ["parallel.ep=2", "parallel.zero_stage=3"], ()),
    "ep2-tp2-sp": (4, 4, ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true"], ()),
    # Megatron-LM's order: each tp rank's own tokens over ep, then the rows gathered over tp
    "ep2-tp2-sp-ep-first": (
        4,
        4,
        ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", EP_FIRST],
        (),
    ),
    "tp2-pp2-sp-ep-first-recompute-shared": (
        4,
        2,
        ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", EP_FIRST, "trainer.recompute=full"],
        ("model.moe.shared_experts=1",),
    ),
    "ep2-pp2-vpp2": (4, 2, ["parallel.ep=2", "parallel.pp=2", "parallel.vpp=2"], ()),
    "ep2-recompute-full": (2, 4, ["parallel.ep=2", "trainer.recompute=full"], ()),
    "ep2-recompute-selective": (2, 4, ["parallel.ep=2", "trainer.recompute=selective"], ()),
    "ep4-cp2-dp2": (4, 4, ["parallel.ep=4", "parallel.cp=2"], ()),
    "ep2-capacity": (2, 4, ["parallel.ep=2"], ("model.moe.capacity_factor=1.0",)),
    # hybrid sharding: dense states in shard groups of 2 dp ranks, experts over their edp group
    "ep2-hybrid-zero3": (
        4,
        2,
        ["parallel.ep=2", "parallel.zero_stage=3", "parallel.zero_shard_size=2"],
        (),
    ),
    "ep2-shared-freq2": (
        2,
        4,
        ["parallel.ep=2"],
        ("model.moe.shared_experts=1", "model.moe.layer_freq=2"),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_matches_one_process(name):
    world, mbs, layout, model = LAYOUTS[name]
    args = [f"trainer.micro_batch_size={mbs}", *MOE, *model, *layout]
    got = run_world(train_layout, world, args, STEPS, timeout=300)
    assert_parity(reference(mbs, model), got)


def test_ep4_pp2_vpp2_zero2_on_eight_ranks():
    layout = ["parallel.ep=4", "parallel.pp=2", "parallel.vpp=2", "parallel.zero_stage=2"]
    got = run_world(
        train_layout, 8, ["trainer.micro_batch_size=1", *MOE, *layout], STEPS, timeout=300
    )
    assert_parity(reference(1), got)


def test_ep_tp_pp_sp_zero1_on_eight_ranks():
    layout = [
        "parallel.ep=2",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.sp=true",
        "parallel.zero_stage=1",
    ]
    got = run_world(
        train_layout, 8, ["trainer.micro_batch_size=2", *MOE, *layout], STEPS, timeout=300
    )
    assert_parity(reference(2), got)


def test_balancing_loss_changes_training():
    """The balancing loss reaches the parameters: a larger coefficient trains differently."""
    a = reference(4)[0].params
    b = train_layout(
        0, 1, ["trainer.micro_batch_size=4", *MOE, "model.moe.router.aux_loss_coef=1.0"], STEPS
    ).params
    assert not torch.allclose(a["layers.0.mlp.router"], b["layers.0.mlp.router"])


def _metrics(rank, world, layout):
    trainer = build_trainer(rank, world, ["trainer.micro_batch_size=4", *MOE, *layout], 1)
    trainer.train_step()
    return trainer.moe_metrics()


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_routing_metrics_count_every_token_and_the_drops(capacity):
    extra = [] if capacity is None else [f"model.moe.capacity_factor={capacity}"]
    one = _metrics(0, 1, extra)
    two = run_world(_metrics, 2, ["parallel.ep=2", *extra])
    tokens_per_layer = 8 * 16 * 2  # global batch x sequence x top-k
    for m in [one, *two]:
        assert m["moe/tokens_per_expert_mean"] == tokens_per_layer / 4
        assert m["moe/tokens_per_expert_max"] >= tokens_per_layer / 4
        for key in ("moe/aux_loss", "moe/z_loss", "moe/tokens_per_expert_max"):
            assert math.isclose(m[key], one[key], rel_tol=1e-5), key
        assert m["moe/dropped_tokens"] == one["moe/dropped_tokens"]
    assert (one["moe/dropped_tokens"] > 0) == (capacity is not None)
    assert 0.0 < one["moe/aux_loss"] and 0.0 < one["moe/z_loss"]


# -- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, world, fragment",
    [
        (["parallel.ep=2", "model.moe.num_experts=0"], 2, "needs experts to split"),
        (["parallel.ep=2", "model.moe.num_experts=3"], 2, "not divisible by parallel.ep=2"),
        (["parallel.ep=4"], 2, "parallel.ep=4 must divide dp=2"),
        (["parallel.ep=4", "parallel.cp=2"], 2, "must divide dp*cp = 1*2 = 2"),
        (["parallel.tp=2"], 2, "need parallel.sp=true"),
        (["model.moe.top_k=5"], 1, "model.moe.top_k=5 must be in [1, model.moe.num_experts=4]"),
        (["model.moe.capacity_factor=0"], 1, "capacity_factor=0.0 must be > 0"),
        (["model.moe.layer_freq=0"], 1, "layer_freq=0 must be >= 1"),
    ],
)
def test_bad_moe_configs_name_the_value_and_the_fix(overrides, world, fragment):
    cfg = tiny_config([*MOE, *overrides], 1)
    errors = config_errors(cfg, world)
    assert any(fragment in e for e in errors), errors
    assert not config_errors(tiny_config([*MOE, "parallel.ep=2"], 1), 2)


# -- bf16 on the wire, decoding -------------------------------------------------------------
def test_bf16_moves_half_the_token_bytes_and_tracks_the_bf16_run():
    """Rows cross the all-to-all in bf16 (half fp32's bytes per row; the int64 counts stay),
    and ep=2 in bf16 tracks one bf16 process within bf16 round-off.

    bf16 router logits round differently from fp32 ones (and differently on different CPUs),
    so the two runs may send some tokens to other experts' ranks: one rank's bytes follow its
    routing. The ep group's total does not: every (token, slot) row crosses dispatch and
    combine once each way, forward and backward, whichever expert it goes to."""
    args = ["trainer.micro_batch_size=4", *MOE]
    bf16 = ["trainer.precision=bf16"]
    fp32_run = run_world(train_layout, 2, [*args, "parallel.ep=2"], 2)
    bf16_run = run_world(train_layout, 2, [*args, *bf16, "parallel.ep=2"], 2)
    one = [train_layout(0, 1, [*args, *bf16], 2)]
    full = [r.stats["ep/all_to_all"] for r in fp32_run]
    half = [r.stats["ep/all_to_all"] for r in bf16_run]
    assert [s["calls"] for s in full] == [s["calls"] for s in half]
    # Per block and microbatch: 1 exchange of 4 int64 counts + 4 row exchanges, on each rank.
    counts = sum(8 * 4 * s["calls"] // 5 for s in full)
    rows_fp32 = sum(s["bytes"] for s in full) - counts
    rows_bf16 = sum(s["bytes"] for s in half) - counts
    tokens = 8 * 16 * 2  # global batch x seq x steps
    assert rows_fp32 == tokens * 2 * 4 * 4 * 64 * 4  # top-2, 4 exchanges, 4 blocks, h, fp32
    assert 2 * rows_bf16 == rows_fp32
    gap = max_relative_loss_gap(losses_of(one), losses_of(bf16_run))
    assert gap < 5e-3 and max_relative_loss_gap(losses_of(fp32_run), losses_of(bf16_run)) > 1e-5


def test_kv_cache_decoding_equals_a_full_forward():
    spec = replace(spec_of(), num_layers=2)
    model = GPTChunk(spec, ParallelContext(), range(2), first=True, last=True).eval()
    init_parameters(model, 3, 0, 1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.head.logits(model(ids)).transpose(0, 1)
        cache = new_cache(model, 2, 8)
        parts = [model.decode(ids[:, :3], cache)]
        parts += [model.decode(ids[:, i : i + 1], cache) for i in range(3, 8)]
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-5


# -- experts that get no tokens, evaluation -------------------------------------------------
def _starved(rank, world, layout):
    """ep=2 x dp=2 under ZeRO 2 (or ep=2 x tp=2 in Megatron's order, whose tp gathers then move
    no rows): the ranks holding experts 2-3 get no token (this forked rank's router sends every
    token to experts 0 and 1); the step completes and experts 2-3 have exactly zero grads."""
    import megatronish.moe.layer as layer

    def first_two(logits, top_k, *args):
        probs, weights, _ = route(logits, top_k, *args)
        return probs, weights, torch.tensor([0, 1]).expand(logits.shape[0], 2)

    layer.route = first_two  # this process only: the ranks are forked
    trainer = build_trainer(
        rank,
        world,
        ["trainer.micro_batch_size=2", *MOE, "parallel.ep=2", *layout],
        1,
    )
    result = trainer.train_step()
    loads = trainer.moe_metrics()
    grads = {}
    for b in trainer.zero.buckets:
        if b.expert:
            grads[tuple(n for n, _ in b.params)] = float(b.grad_shard.abs().max())
    return result.loss, loads, trainer.topo.coords.dp, grads


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.zero_stage=2"],
        ["parallel.zero_stage=2", "parallel.tp=2", "parallel.sp=true", EP_FIRST],
    ],
    ids=["dp2-zero2", "tp2-ep-first"],
)
def test_experts_without_tokens_train_without_hanging(layout):
    results = run_world(_starved, 4, layout, timeout=120)
    for loss, loads, dp_rank, grads in results:
        assert loss != loss or math.isfinite(loss)
        assert loads["moe/tokens_per_expert_max"] == 2 * loads["moe/tokens_per_expert_mean"]
        if dp_rank % 2 == 1:  # ep rank 1 holds experts 2 and 3
            assert grads and all(g == 0.0 for g in grads.values())


def test_evaluation_with_expert_parallelism_matches_one_process():
    args = ["trainer.micro_batch_size=4", *MOE, "trainer.eval_interval=2", "trainer.eval_iters=2"]

    def valid(rank, world, layout):
        trainer = build_trainer(rank, world, [*args, *layout], 2)
        trainer.fit()
        return trainer._evaluate(trainer.train_data)  # the harness has no validation set

    one = valid(0, 1, [])
    two = run_world(valid, 2, ["parallel.ep=2"])
    for v in two:
        assert math.isclose(v, one, rel_tol=1e-5), (v, one)


def _routing_stats(rank, world, layout):
    """The step's routing metrics and every block's statistics summed over the ranks."""
    from megatronish.moe.metrics import moe_layers

    trainer = build_trainer(rank, world, ["trainer.micro_batch_size=4", *MOE, *layout], 1)
    trainer.train_step()
    stats = torch.stack([m.stats for m in moe_layers(trainer.chunks)])
    if world > 1:
        dist.all_reduce(stats)
    return trainer.moe_metrics(), stats


def test_routing_metrics_under_tp_and_sp_equal_one_process():
    """Each tp rank routes its own sequence shard: the tokens per expert, the balancing and z
    losses and the drops of a step are counted once over tp, as one process counts them.

    tp sums partial products in another order than one process does, so a token whose top-2 (or
    whose place in an expert's capacity) is within round-off of a tie may go elsewhere on some
    CPU: per-expert counts and drops are compared within a few assignments, the totals exactly
    (a bug counting each tp copy, or one shard only, doubles or halves them)."""
    layout = ["model.moe.capacity_factor=0.5"]
    one, one_stats = _routing_stats(0, 1, layout)
    assignments = 8 * 16 * 2  # batch x sequence x top-k, per block
    for m, stats in run_world(_routing_stats, 2, [*layout, "parallel.tp=2", "parallel.sp=true"]):
        assert m["moe/tokens_per_expert_mean"] == assignments / 4
        assert stats[:, :-3].sum(dim=1).tolist() == [assignments] * stats.shape[0]
        assert (stats[:, :-3] - one_stats[:, :-3]).abs().max() <= 2  # assignments per expert
        assert (stats[:, -1] - one_stats[:, -1]).abs().max() <= 2  # dropped
        assert torch.allclose(stats[:, -3:-1], one_stats[:, -3:-1], rtol=1e-2, atol=0)
        for key in one:
            assert math.isclose(m[key], one[key], rel_tol=2e-2), (key, m[key], one[key])
    assert one["moe/dropped_tokens"] > 0 and one["moe/aux_loss"] > 0 and one["moe/z_loss"] > 0


def test_step_metrics_keep_each_block_in_its_own_row():
    """A chunk's MoE blocks report under their global layer index: a later stage's blocks
    (layers 2 and 3 of 4) sum into the step's metrics without overwriting each other."""
    spec = replace(spec_of(), num_layers=4)
    chunk = GPTChunk(spec, ParallelContext(), range(2, 4), first=False, last=False)
    layers = moe_metrics.moe_layers([chunk])
    assert [layer.layer_id for layer in layers] == [2, 3]
    for i, layer in enumerate(layers):  # assignments per expert, then aux, z, dropped
        layer.stats.copy_(torch.tensor([4.0, 2, 1, 1, 0.5, 0.25, 3], dtype=torch.float64) * (i + 1))
    world = ParallelGroup("world", (0,), 0)
    got = moe_metrics.step_metrics(layers, 4, 4, world, 1, 2, torch.device("cpu"))
    assert got["moe/aux_loss"] == (0.5 + 1.0) / 2  # both blocks, mean over 2 microbatches
    assert got["moe/z_loss"] == (0.25 + 0.5) / 2
    assert got["moe/dropped_tokens"] == 3 + 6
    assert got["moe/tokens_per_expert_max"] == 8
    assert got["moe/tokens_per_expert_mean"] == (8 + 16) / 8
