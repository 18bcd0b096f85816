"""``trainer.compile``: compiled blocks train as eager ones, in every layout, and say how they
were compiled.

One process compiles with inductor (generated C++ kernels on CPU; ~30 s cold, most of it the
first compile, shared through inductor's cache by the rest of the session). The multi-process
layouts use the ``aot_eager`` backend: the same dynamo capture, graph breaks and AOTAutograd
forward/backward graphs, run by eager kernels, so each world does not pay inductor's code
generation; inductor's numerics are what the one-process test holds.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from megatronish.distributed.comm import ParallelGroup, all_gather_dim0
from megatronish.model.compile import CompiledForward, compile_blocks, graph_break_reason
from megatronish.testing.compare import assert_same_norms, max_relative_loss_gap, param_gaps
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout

COMPILED = ["trainer.compile=true"]
AOT = [*COMPILED, "trainer.compile_backend=aot_eager"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
STEPS = 3
# fp32: compiled kernels fuse and reorder sums. Losses and step 1's grad norm (the same params)
# within this; later grad norms drift with the params as Adam amplifies round-off (10x).
ROUND_OFF = 1e-6


def assert_compiled_matches_eager(eager, compiled, rtol=ROUND_OFF):
    assert max_relative_loss_gap(losses_of(eager), losses_of(compiled)) < rtol
    for a, b in zip(eager, compiled, strict=True):  # step 1 within rtol, then Adam's drift
        assert_same_norms(a.grad_norms, b.grad_norms, rtol=10 * rtol)
    model_gap, _ = param_gaps(merge_params(eager), merge_params(compiled))
    assert model_gap < 10 * rtol, model_gap


def compiled_forwards(trainer) -> list[CompiledForward]:
    return [block.forward for chunk in trainer.chunks for block in chunk.layers.values()]


def inductor_graphs() -> int:
    """Graphs inductor compiled or loaded from its cache in this process so far."""
    seen = counters["inductor"]
    return seen["fxgraph_cache_miss"] + seen["fxgraph_cache_hit"]


def test_a_collective_of_more_than_one_rank_is_not_traced():
    """By construction the collectives run eagerly between graphs; a group of one is traced."""

    def gather(x, group):
        return all_gather_dim0(x * 2, group) + 1

    one = ParallelGroup(name="tp", ranks=(0,), rank=0, pg=None)
    whole = torch.compile(gather, backend="aot_eager", fullgraph=True)
    assert torch.equal(whole(torch.ones(2), one), torch.full((2,), 3.0))
    two = ParallelGroup(name="tp", ranks=(0, 1), rank=0, pg=None)  # never reached: no op runs
    with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
        whole(torch.ones(2), two)
    reason = graph_break_reason(caught.value)
    assert "all_gather_dim0" in reason and " at 0x" not in reason, reason


@pytest.mark.slow  # ~30 s with a cold inductor cache
def test_one_process_compiled_with_inductor_trains_as_eager_and_resumes_bit_identically(
    tmp_path, scalar_code_on_baseline_kernels
):
    eager = train_layout(0, 1, [], STEPS + 1)
    trainer = build_trainer(0, 1, COMPILED, STEPS + 1)
    before = inductor_graphs()
    history = trainer.fit()
    assert inductor_graphs() >= before + 2  # a forward and a backward graph, made or cached
    forwards = compiled_forwards(trainer)
    assert len(forwards) == 4 and all(f.fullgraph for f in forwards)  # one graph per block
    assert forwards[0].backend == "inductor"
    got = [r.loss for r in history]
    assert max_relative_loss_gap(eager.losses, got) < ROUND_OFF
    assert_same_norms(eager.grad_norms, [r.grad_norm for r in history], rtol=10 * ROUND_OFF)

    # A compiled run's checkpoint resumes compiled bit for bit, and eager within round-off.
    saved = train_layout(0, 1, COMPILED, STEPS - 1, save=str(tmp_path))
    resumed = train_layout(0, 1, COMPILED, STEPS + 1, load=str(tmp_path))
    assert saved.losses + resumed.losses[-2:] == got[: STEPS - 1] + got[-2:]
    assert resumed.losses[-2:] == got[-2:]
    as_eager = train_layout(0, 1, [], STEPS + 1, load=str(tmp_path))
    assert max_relative_loss_gap(eager.losses[-2:], as_eager.losses[-2:]) < ROUND_OFF


def _eager_then_compiled(rank, world, overrides):
    return (
        train_layout(rank, world, overrides, STEPS),
        train_layout(rank, world, [*overrides, *AOT], STEPS),
    )


LAYOUTS = {  # (world, overrides): every layout the issue names, in three small worlds
    "tp2-sp-pp2-vpp2": (
        4,
        ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.vpp=2"],
    ),
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    "moe-cp2-ep2": (2, [*MOE, "parallel.cp=2", "parallel.ep=2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layouts_train_as_eager(layout):
    """Collectives between graphs (tp, sp, cp, ep), ZeRO 3's gather hooks around the compiled
    forwards, and the pipeline's chunks: the same losses, grad norms and params as eager."""
    world, overrides = LAYOUTS[layout]
    runs = run_world(_eager_then_compiled, world, overrides)
    eager, compiled = [r[0] for r in runs], [r[1] for r in runs]
    assert_compiled_matches_eager(eager, compiled)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_more_blocks_than_dynamos_recompile_limit_share_one_graph(arch):
    """Blocks of one structure share one compiled graph (their params are graph inputs, nothing
    guards on which block runs): with dynamo's recompile limit (8 by default) below the number
    of blocks, no block recompiles, so the limit, which raises instead of silently running a
    block eagerly (``fail_on_recompile_limit_hit``), is never reached."""
    limit, layers = 2, 5
    torch._dynamo.reset()  # no cache entry left by another test's blocks
    counters.clear()
    overrides = [*AOT, f"model.arch={arch}", f"model.num_layers={layers}"]
    with torch._dynamo.config.patch(recompile_limit=limit):
        trainer = build_trainer(0, 1, overrides, 2)
        try:
            trainer.fit()  # two steps: every block's forward and backward, twice
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            pytest.fail(f"a block recompiled past the limit of {limit}: {e}")
        assert torch._dynamo.config.fail_on_recompile_limit_hit  # a hit raises, never hides
    forwards = compiled_forwards(trainer)
    assert len(forwards) == layers > limit and all(f.fullgraph for f in forwards)
    assert counters["stats"]["unique_graphs"] == 1  # one capture serves every block


class _Block(torch.nn.Module):
    def __init__(self, breaks: bool):
        super().__init__()
        self.breaks = breaks
        self.weight = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        x = x * self.weight
        if self.breaks:
            torch._dynamo.graph_break()
        return x + 1


class _Chunk(torch.nn.Module):
    def __init__(self, breaks: bool):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block(breaks) for i in range(2)})


@pytest.mark.parametrize("breaks", [False, True])
def test_a_block_that_cannot_be_captured_whole_falls_back_in_pieces_and_says_why_once(breaks):
    logged = []
    chunk = _Chunk(breaks)
    forwards = compile_blocks([chunk], "aot_eager", logged.append)
    x = torch.ones(3, requires_grad=True)
    for block in chunk.layers.values():
        y = block(x)
        y.sum().backward()
        assert torch.equal(y, torch.full((3,), 3.0))
    assert torch.equal(x.grad, torch.full((3,), 4.0))
    assert [f.fullgraph for f in forwards] == [not breaks] * 2
    assert [f.name for f in forwards] == ["layers.0", "layers.1"]
    if breaks:  # one line for both blocks, naming the first and the reason
        assert len(logged) == 1 and logged[0].startswith("layers.0 and blocks like it"), logged
        assert "graph_break" in logged[0], logged
    else:
        assert logged == []
    assert dict(chunk.state_dict()).keys() == {"layers.0.weight", "layers.1.weight"}


def test_the_cache_dir_is_where_inductor_looks(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # restored after
    build_trainer(0, 1, [*AOT, f"trainer.compile_cache_dir={tmp_path}/cache"], 1)
    assert cache_dir() == f"{tmp_path}/cache"


def test_graph_break_reason_is_one_line_without_addresses():
    error = torch._dynamo.exc.Unsupported(
        "Data dependent operator\n  Explanation: Operator `aten._local_scalar_dense.default` "
        "has a non-Tensor output\n  Hint: see <function f at 0x7f00>"
    )
    assert graph_break_reason(error) == (
        "Data dependent operator (Operator `aten._local_scalar_dense.default` has a non-Tensor "
        "output)"
    )
