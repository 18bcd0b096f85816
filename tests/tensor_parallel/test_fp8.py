"""``trainer.fp8``: each fp8 GEMM is the product of its dequantized operands to the output's
rounding, the blocks' linears really run in fp8, and training tracks bf16 in every layout."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.config.validate import config_errors
from megatronish.model.compile import graph_break_reason
from megatronish.moe.fp8_grouped import (
    PaddedGroups,
    fp8_experts_supported,
    fp8_grouped_linear,
    padded_size,
    scaled_grouped_mm,
)
from megatronish.moe.grouped_mm import expert_offsets
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.moe import fp8_expert_backward_peak
from megatronish.tensor_parallel.fp8 import (
    E4M3,
    E5M2,
    FAST_ACCUM,
    MIN_AMAX,
    _Fp8Linear,
    column_major,
    power_of_2_scale,
    quantize,
)
from megatronish.testing import runs as test_runs
from megatronish.testing.host_syncs import HostSyncRecorder
from megatronish.testing.live_bytes import PeakLiveBytes
from megatronish.testing.memory import activations_by_stage, measure_layout
from megatronish.testing.moved_bytes import MovedBytes
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, train_layout
from megatronish.training.job import fp8_note

BF16 = ["trainer.precision=bf16"]
BF = torch.bfloat16
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.router.z_loss_coef=0.001"]
TRACK_STEPS = 30
TINY = 2.0**-126  # smallest normal fp32: below it only the accumulation's absolute error counts


def dequantized(t, dtype, dim=None, power_of_2=False):
    q, scale = quantize(t, dtype, dim, power_of_2)
    return q.double() * scale.double()


def scaled(t, dim):
    """``t`` as the experts cast it: e4m3, by slices along ``dim``, power-of-two scales."""
    return dequantized(t, E4M3, dim, power_of_2=True)


def is_power_of_2(t: torch.Tensor) -> bool:
    return bool(torch.frexp(t).mantissa.eq(0.5).all())


@pytest.mark.parametrize("dtype, mantissa, subnormal", [(E4M3, 3, 2.0**-9), (E5M2, 2, 2.0**-16)])
@pytest.mark.parametrize("dim", [None, -1, 0])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_quantize_scales_by_amax_and_rounds_each_value_to_its_format(
    dtype, mantissa, subnormal, dim, power_of_2
):
    t = torch.randn(64, 48, dtype=torch.bfloat16) * torch.logspace(-3, 3, 48)
    q, scale = quantize(t, dtype, dim, power_of_2)
    top = torch.finfo(dtype).max
    assert q.dtype == dtype and scale.dtype == torch.float32
    amax = t.float().abs() if dim is None else t.float().abs()
    amax = amax.amax() if dim is None else amax.amax(dim=dim, keepdim=True)
    if power_of_2:  # torchao's rounding: the multiplier top / amax down to a power of two
        assert is_power_of_2(scale)
        assert (scale >= amax / top).all() and (scale < 2 * amax / top).all()
    else:
        torch.testing.assert_close(scale, amax / top, rtol=0, atol=0)
    assert q.float().abs().amax() <= top
    # Round to nearest: half a spacing, relative for normals, absolute for subnormals.
    error = (q.double() * scale.double() - t.double()).abs()
    bound = t.double().abs() * 2.0 ** -(mantissa + 1) + scale.double() * subnormal / 2
    assert (error <= bound).all(), float((error - bound).max())


def _gemm_bound(a, b):
    """bf16 rounding of the output plus fp32 accumulation over the summed dimension."""
    ref = a @ b
    return ref, ref.abs() * 2.0**-8 + (a.abs() @ b.abs()) * (a.shape[1] * 2.0**-23) + TINY


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_gemm_equals_the_product_of_its_dequantized_operands(recipe):
    """Forward, input grad and weight grad: ``_scaled_mm``'s output is the exact product of the
    operands' fp8 values times their scales, to the bf16 output's rounding; tensorwise: exact
    scales per tensor, e4m3 for input and weight, e5m2 for the output grad; rowwise: every
    operand e4m3, scaled by the rows and columns kept, by powers of two."""
    torch.manual_seed(0)
    x = torch.randn(3, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(3, 32, 48, dtype=torch.bfloat16) * 1e-3
    y = _Fp8Linear.apply(x, w, recipe)
    y.backward(g)
    x2, g2 = x.detach().reshape(-1, 64), g.reshape(-1, 48)
    wd = w.detach()
    rows = recipe == "rowwise"
    grad_dtype = E4M3 if rows else E5M2
    cases = {  # name: (got, left operand, right operand), dequantized as the recipe casts them
        "forward": (
            y.reshape(-1, 48),
            dequantized(x2, E4M3, -1 if rows else None, rows),
            dequantized(wd, E4M3, -1 if rows else None, rows).t(),
        ),
        "input grad": (
            x.grad.reshape(-1, 64),
            dequantized(g2, grad_dtype, -1 if rows else None, rows),
            dequantized(wd, E4M3, 0 if rows else None, rows),
        ),
        "weight grad": (
            w.grad,
            dequantized(g2.t(), grad_dtype, -1 if rows else None, rows),
            dequantized(x2, E4M3, 0 if rows else None, rows),
        ),
    }
    for name, (got, a, b) in cases.items():
        ref, bound = _gemm_bound(a, b)
        assert got.dtype == torch.bfloat16, name
        assert ((got.double() - ref).abs() <= bound).all(), name
    exact = x2.double() @ wd.double().t()  # and fp8 is near the product it stands in for
    assert (y.reshape(-1, 48).double() - exact).norm() / exact.norm() < 0.1


def argument(func, args, kwargs, name):
    """The value of ``func``'s argument ``name`` in a dispatched call (its default if not given)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            if arg.name in (kwargs or {}):
                return kwargs[arg.name]
            return args[i] if i < len(args) else arg.default_value
    raise KeyError(name)


GROUPED_STAND_IN = "scaled_grouped_mm_reference"  # torch._scaled_grouped_mm's, on CPU


class ScaledMatmuls(TorchDispatchMode):
    """Counts ``_scaled_mm`` calls by operand dtypes (the experts' CPU stand-in for
    ``_scaled_grouped_mm`` by that name), and the other matmuls by dtype; records every fp8
    GEMM's scales and ``use_fast_accum``."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()
        self.scales: list[torch.Tensor] = []  # both operands' scales of every fp8 GEMM
        self.fast_accum: list[bool] = []  # every fp8 GEMM's, in call order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name == "_scaled_mm":
            self.seen[(name, str(args[0].dtype), str(args[1].dtype))] += 1
            self.scales += [args[2].clone(), args[3].clone()]
            self.fast_accum.append(argument(func, args, kwargs, "use_fast_accum"))
            # cuBLASLt's layouts (the CPU kernel takes any): row-major left, column-major right
            assert args[0].is_contiguous() and args[1].t().is_contiguous(), "operand layout"
        elif name == GROUPED_STAND_IN:  # runs torch's meta kernel checking CUDA's rules
            self.seen[("_scaled_grouped_mm", str(args[0].dtype), str(args[1].dtype))] += 1
            self.scales += [args[2].clone(), args[3].clone()]
            self.fast_accum.append(argument(func, args, kwargs, "fast_accum"))
            assert args[0].is_contiguous() and args[1].stride(-2) == 1, "operand layout"
        elif name in ("mm", "addmm", "bmm", "_grouped_mm"):
            self.seen[(name, str(args[0].dtype))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_fp8_gemm_takes_the_operand_layouts_cublas_takes(recipe):
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    with ScaledMatmuls() as mode:
        _Fp8Linear.apply(x, w, recipe).sum().backward()
    assert sum(mode.seen.values()) == 3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_recipes_are_torchaos(recipe):
    """torchao's recipes of the same names: tensorwise casts the output grad to e5m2 with exact
    scales; rowwise casts every operand of all three GEMMs to e4m3 with power-of-two scales."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    with ScaledMatmuls() as mode:
        _Fp8Linear.apply(x, w, recipe).backward(torch.randn(2, 16, 48, dtype=BF) * 1e-3)
    e4m3, e5m2 = str(E4M3), str(E5M2)
    if recipe == "rowwise":
        assert mode.seen == {("_scaled_mm", e4m3, e4m3): 3}
        assert all(is_power_of_2(s) for s in mode.scales)
    else:
        assert mode.seen == {("_scaled_mm", e4m3, e4m3): 1, ("_scaled_mm", e5m2, e4m3): 2}
        assert not all(is_power_of_2(s) for s in mode.scales)


@pytest.mark.slow  # ~10 s: inductor compiles both recipes' forward and backward
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_fp8_linears_equal_eager_ones(recipe, scalar_code_on_baseline_kernels):
    """Under torch.compile inductor lays out the casts itself and lowers ``_scaled_mm`` with
    cuBLASLt's layout rule (a transposed output grad once reached it column-major)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 16, 48, dtype=torch.bfloat16)

    def grads(fn):
        x.grad = w.grad = None
        out = fn(x, w)
        out.backward(g)
        return out.detach(), x.grad, w.grad

    eager = grads(lambda a, b: _Fp8Linear.apply(a, b, recipe))
    compiled = grads(torch.compile(lambda a, b: _Fp8Linear.apply(a, b, recipe), fullgraph=True))
    for a, b in zip(eager, compiled, strict=True):  # the same fp8 values; bf16 outputs
        torch.testing.assert_close(b, a, rtol=2**-7, atol=1e-5)


def test_the_blocks_linears_run_in_fp8_and_the_first_and_last_blocks_can_stay_bf16():
    trainer = build_trainer(0, 1, [*BF16, "trainer.fp8=tensorwise"], 1)
    microbatches = len(trainer.microbatches(trainer.train_data, 0))
    with ScaledMatmuls() as mode:
        trainer.train_step()
    linears = 4 * 4 * microbatches  # 4 blocks x (qkv, proj, fc1, fc2)
    fp8 = "torch.float8_e4m3fn"
    assert mode.seen[("_scaled_mm", fp8, fp8)] == linears  # forward: input and weight e4m3
    assert mode.seen[("_scaled_mm", "torch.float8_e5m2", fp8)] == 2 * linears  # both grads
    skipped = build_trainer(0, 1, [*BF16, "trainer.fp8=rowwise", "trainer.fp8_skip_first_last=1"])
    with ScaledMatmuls() as mode:
        skipped.train_step()
    assert mode.seen[("_scaled_mm", fp8, fp8)] == 3 * linears // 2  # blocks 1 and 2 only


def test_each_expert_gemm_equals_the_product_of_its_dequantized_operands():
    """The experts' three GEMMs in e4m3, each to the bf16 output's rounding, scaled along what
    is not summed: forward and input grad by token row and by each expert's weight columns /
    rows; the weight grad by each expert's columns of the output grad and of the input over
    that expert's tokens (summed in groups padded to 16 rows); an expert without rows too. Every
    scale a power of two (torchao's MoE recipe)."""
    torch.manual_seed(0)
    counts = [5, 0, 27]
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(3, 48, 64) * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(32, 48, dtype=torch.bfloat16) * 1e-3
    y = fp8_grouped_linear(x, w, counts)
    y.backward(g)
    for e, (rows, xe, ge) in enumerate(
        zip(
            torch.arange(32).split(counts),
            x.detach().split(counts),
            g.split(counts),
            strict=True,
        )
    ):
        if not len(rows):
            assert not w.grad[e].any()  # the expert without rows: a padded group of zeros
            continue
        wd = w.detach()[e]
        cases = {
            "forward": (y[rows], scaled(xe, -1), scaled(wd, -1).t()),
            "input grad": (x.grad[rows], scaled(ge, -1), scaled(wd, 0)),
            "weight grad": (w.grad[e], scaled(ge.t(), -1), scaled(xe, 0)),
        }
        for name, (got, a, b) in cases.items():
            ref, bound = _gemm_bound(a, b)
            assert got.dtype == torch.bfloat16, name
            assert ((got.double() - ref).abs() <= bound).all(), (name, e)


def test_the_expert_gemm_on_cpu_holds_to_the_cuda_kernels_rules():
    """The CPU stand-in for ``torch._scaled_grouped_mm`` refuses what CUDA's kernel refuses."""
    x8, sx = quantize(torch.randn(16, 32), E4M3, -1)
    w8, sw = quantize(torch.randn(2, 48, 32), E4M3, -1)
    offsets = expert_offsets([6, 10], x8.device)
    ok = (x8, w8.transpose(-2, -1), sx.squeeze(-1), sw.squeeze(-1), offsets)
    assert scaled_grouped_mm(*ok, torch.bfloat16).shape == (16, 48)
    wrong = {
        "column major": (x8, w8.transpose(-2, -1).contiguous(), *ok[2:]),
        "E4M3": (x8, w8.to(E5M2).transpose(-2, -1), *ok[2:]),
        "scale": (x8, ok[1], sx, *ok[3:]),  # [rows, 1] where CUDA takes [rows]
    }
    for fragment, args in wrong.items():
        with pytest.raises(RuntimeError, match=fragment):
            scaled_grouped_mm(*args, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        scaled_grouped_mm(*ok, torch.float32)
    gt8, xs8 = torch.ones(48, 32).to(E4M3), torch.ones(32, 16).to(E4M3)  # weight grad: 2d x 2d
    scales = torch.ones(2 * 48), torch.ones(2 * 16)
    offsets16 = expert_offsets([16, 16], xs8.device)
    summed = scaled_grouped_mm(gt8, column_major(xs8), *scales, offsets16, BF)
    assert summed.shape == (2, 48, 16) and summed.eq(16).all()  # 16 rows of ones per group
    uneven = expert_offsets([6, 26], xs8.device)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):  # a device assert on CUDA
        scaled_grouped_mm(gt8, column_major(xs8), *scales, uneven, BF)


def test_fp8_experts_run_where_the_grouped_kernel_is_and_the_start_up_line_says_so():
    assert fp8_experts_supported(torch.device("cpu"), None)  # the reference, for the tests
    cuda = torch.device("cuda")
    assert fp8_experts_supported(cuda, (9, 0))  # H100, H200: CUTLASS's SM90 kernel
    assert not any(fp8_experts_supported(cuda, c) for c in [(8, 9), (10, 0), (12, 0), None])
    note = fp8_note("rowwise", 1, 4, 2, torch.device("cpu"))
    assert note.startswith("[fp8] rowwise: 4 linear layers on this rank run in fp8, and the ")
    assert "experts of 2 blocks" in note and "the first and last 1 blocks in bf16" in note


def test_the_experts_run_their_three_gemms_in_fp8():
    trainer = build_trainer(0, 1, [*BF16, *MOE, "trainer.fp8=rowwise"], 1)
    microbatches = len(trainer.microbatches(trainer.train_data, 0))
    with ScaledMatmuls() as mode:
        trainer.train_step()
    stacks = 4 * 2 * microbatches  # 4 blocks x (fc1, fc2)
    fp8 = "torch.float8_e4m3fn"
    assert mode.seen[("_scaled_grouped_mm", fp8, fp8)] == 3 * stacks
    assert mode.seen[("_grouped_mm", "torch.bfloat16")] == 0
    skipped = [*BF16, *MOE, "trainer.fp8=tensorwise", "trainer.fp8_skip_first_last=1"]
    with ScaledMatmuls() as mode:
        build_trainer(0, 1, skipped, 1).train_step()
    assert mode.seen[("_scaled_grouped_mm", fp8, fp8)] == 3 * stacks // 2  # blocks 1 and 2
    assert mode.seen[("_grouped_mm", "torch.bfloat16")] == 3 * stacks // 2  # blocks 0 and 3


@pytest.mark.slow  # ~30 s: five 30-step bf16 runs in one process
def test_thirty_steps_in_fp8_track_bf16_and_differ_from_it():
    bf16 = build_trainer(0, 1, BF16, TRACK_STEPS).fit()
    for recipe in ("tensorwise", "rowwise"):
        fp8 = build_trainer(0, 1, [*BF16, f"trainer.fp8={recipe}"], TRACK_STEPS).fit()
        gaps = [abs(a.loss - b.loss) / a.loss for a, b in zip(bf16, fp8, strict=True)]
        assert max(gaps) < 0.02, (recipe, max(gaps))  # measured 0.5% on the tiny llama
        assert gaps[-1] < 0.01, (recipe, gaps[-1])  # measured 0.06-0.09%
        assert max(gaps) > 1e-4, recipe  # fp8 really ran: rounding this coarse shows
    bf16 = build_trainer(0, 1, [*BF16, *MOE], TRACK_STEPS).fit()
    fp8 = build_trainer(0, 1, [*BF16, *MOE, "trainer.fp8=rowwise"], TRACK_STEPS).fit()
    gaps = [abs(a.loss - b.loss) / a.loss for a, b in zip(bf16, fp8, strict=True)]
    assert 1e-4 < max(gaps) < 0.02 and gaps[-1] < 0.01, gaps  # the experts too


def _fp8_run(rank, world, overrides):
    run = train_layout(rank, world, overrides, 4)
    trainer = build_trainer(rank, world, overrides, 1)
    with ScaledMatmuls() as mode:
        trainer.train_step()
    return run, mode.scales[0]  # the first forward GEMM: block 0's qkv, its input's scale


FP8_LAYOUTS = {  # name: (the model, the layout, the largest relative loss gap to one process)
    "tp2-sp": ([], ["parallel.tp=2", "parallel.sp=true"], 5e-3),  # measured 1.9e-4
    "dp2-zero1": ([], ["parallel.zero_stage=1"], 1e-6),  # measured 8.7e-8
    "moe-ep2": (MOE, ["parallel.ep=2"], 5e-3),  # measured 4.2e-5 (bf16 ep2: 9.0e-5)
}


@pytest.mark.parametrize("layout", list(FP8_LAYOUTS))
def test_fp8_layouts_track_one_fp8_process(layout):
    """tp shards quantize with their own scales (the weight shards, the row-parallel input),
    so tp tracks one process rather than equalling it; dp does not change what is quantized.
    The column-parallel input is the same tensor on every tp rank, and so is its scale. ep:
    the token rows' scales do not depend on where an expert is, but its weight grad's scales
    (per column over the expert's tokens) and its bf16 output span both ranks' tokens at once."""
    model, parallel, bound = FP8_LAYOUTS[layout]
    fp8 = [*BF16, *model, "trainer.fp8=tensorwise"]
    one = train_layout(0, 1, fp8, 4)
    runs = run_world(_fp8_run, 2, [*fp8, *parallel])
    gaps = [abs(a - b) / a for a, b in zip(one.losses, losses_of([r[0] for r in runs]))]
    assert max(gaps) < bound, gaps
    if layout == "tp2-sp":
        assert torch.equal(runs[0][1], runs[1][1])


@pytest.mark.slow  # ~15 s: two bf16 steps measured in one process
def test_the_planner_counts_what_tensorwise_fp8_keeps():
    """The linears' fp8 input copies: the planned saving against bf16 is the measured one."""
    shape = ["model.seq_length=64", "trainer.micro_batch_size=4", "trainer.global_batch_size=16"]
    planned, measured = {}, {}
    for name, extra in (("bf16", BF16), ("fp8", [*BF16, "trainer.fp8=tensorwise"])):
        overrides = [*shape, *extra]
        measured[name] = activations_by_stage(measure_layout(1, overrides))[0]
        cfg = test_runs.test_config(overrides, 5)
        planned[name] = make_plan(spec_of(cfg), layout_from_config(cfg, 1)).stages[0].step_extra
        assert 0.85 <= planned[name] / measured[name] <= 1.15, name
    saved = measured["bf16"] - measured["fp8"]  # 196,544 bytes of 3.09 MB measured
    assert saved > 0
    assert planned["bf16"] - planned["fp8"] == pytest.approx(saved, rel=0.1)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["trainer.fp8=tensorwise"], "needs trainer.precision=bf16"),
        ([*BF16, "trainer.fp8=blockwise"], "trainer.fp8='blockwise' is not one of"),
        ([*BF16, "trainer.fp8=rowwise", "trainer.fp8_skip_first_last=2"], "keeps all 4 blocks"),
        ([*BF16, "trainer.fp8_skip_first_last=-1"], "must be >= 0"),
        (
            [*BF16, "trainer.fp8=tensorwise", "model.ffn_hidden_size=120"],
            "multiple of 16 (cuBLASLt's and CUTLASS's fp8 kernels), but ffn / tp 120;",
        ),
        (
            [*BF16, "trainer.fp8=rowwise", "parallel.tp=2", "model.seq_length=20"],
            "but tokens per micro batch 40;",
        ),
        (
            [*BF16, "trainer.fp8=rowwise", "parallel.pp=2", "parallel.pipeline_schedule=zb-h1"],
            "does not split its backward",
        ),
    ],
)
def test_fp8_config_errors_name_the_value_and_the_fix(overrides, fragment):
    world = 2 if "parallel.pp=2" in overrides or "parallel.tp=2" in overrides else 1
    errors = config_errors(test_runs.test_config(overrides, 10), world, data=False)
    assert any(fragment in e for e in errors), errors


# -- the casts' cost: the same bits in fewer bytes ------------------------------------------


def _quantize_in_fp32(t, dtype, dim=None, power_of_2=False):
    """The cast as first written: a whole-tensor fp32 copy, its abs, the amax, a division and
    a clamp before the cast (39 bytes moved an element of a bf16 tensor)."""
    top = torch.finfo(dtype).max
    t32 = t.float()
    amax = t32.abs().amax() if dim is None else t32.abs().amax(dim=dim, keepdim=True)
    amax = amax.clamp(min=MIN_AMAX)
    scale = power_of_2_scale(amax, top) if power_of_2 else amax / top
    return (t32 / scale).clamp(-top, top).to(dtype), scale


def _padded_quantize_by_scatter(counts, t):
    """The experts' weight-grad cast as first written: each group's amax by ``scatter_reduce``
    over its rows, then the fp32 cast, then the fp8 rows copied into the padded groups."""
    top = torch.finfo(E4M3).max
    groups = PaddedGroups(counts, expert_offsets(counts, t.device))
    group_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    t32 = t.float()
    index = group_of_row[:, None].expand_as(t32)
    amax = t32.new_zeros(len(counts), t.shape[1]).scatter_reduce_(0, index, t32.abs(), "amax")
    scale = power_of_2_scale(amax.clamp(min=MIN_AMAX), top)
    q = (t32 / scale[group_of_row]).clamp(-top, top).to(E4M3)
    padded = torch.zeros(groups.rows, t.shape[1], dtype=torch.uint8)
    padded.index_copy_(0, groups.destination, q.view(torch.uint8))
    return padded.view(E4M3), scale.flatten()


def _inputs(dtype=torch.bfloat16):
    """Random values over 60 decades, rows of zeros, values near bf16's largest and below
    fp8's smallest, an all-zero tensor, a 3-d stack."""
    torch.manual_seed(0)
    wide = torch.randn(37, 29) * torch.logspace(-30, 30, 29)[torch.randperm(29)]
    outliers = torch.randn(37, 29)
    outliers[3] = 0
    outliers[:, 4] = 3e38
    outliers[5, :3] = torch.tensor([1e-30, -1e-38, 2e-41])
    cases = {
        "wide": wide,
        "outliers": outliers,
        "tiny": torch.randn(37, 29) * 1e-39,
        "zeros": torch.zeros(37, 29),
        "stack": torch.randn(3, 20, 24) * torch.logspace(-4, 4, 24),
    }
    return {name: t.to(dtype) for name, t in cases.items()}


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dim", [None, -1, 0])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_the_cast_gives_the_fp32_casts_bits(source, dtype, dim, power_of_2):
    """The amax in the input's own dtype (abs is exact), a power-of-two scale applied by a
    multiplication in that dtype, no clamp (the quotient never leaves the format's range by
    more than a rounding the cast takes back): every fp8 byte and scale as the fp32 cast's."""
    for name, t in _inputs(source).items():
        want, want_scale = _quantize_in_fp32(t, dtype, dim, power_of_2)
        got, scale = quantize(t, dtype, dim, power_of_2)
        assert _same_bits(got, want) and torch.equal(scale, want_scale), name
    t = _inputs(source)["wide"].clone()
    t[5, 5] = float("inf")  # an overflowed step: NaN where the fp32 cast gives NaN
    want, want_scale = _quantize_in_fp32(t, dtype, dim, power_of_2)
    got, scale = quantize(t, dtype, dim, power_of_2)
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan) and torch.equal(scale, want_scale)
    assert _same_bits(got[~nan], want[~nan])


@pytest.mark.parametrize(
    "dtype, dim, power_of_2, bound",
    [(E4M3, None, False, 13), (E5M2, None, False, 13), (E4M3, -1, True, 9), (E4M3, 0, True, 9)],
)
def test_the_cast_moves_a_third_of_the_bytes(dtype, dim, power_of_2, bound):
    """Bytes every op reads and writes per element of a bf16 [256, 512] tensor: tensorwise 13
    (the amax 2, the fp32 quotient 6, the cast 5), rowwise 9 (the amax 2, the bf16 product 4,
    the cast 3), against 39 for the fp32 copy, abs, amax, division and clamp."""
    t = torch.randn(256, 512, dtype=torch.bfloat16)
    with MovedBytes() as before:
        _quantize_in_fp32(t, dtype, dim, power_of_2)
    with MovedBytes() as moved:
        quantize(t, dtype, dim, power_of_2)
    assert before.total / t.numel() >= 39, dict(before.by_op)
    assert moved.total / t.numel() < bound + 0.5, dict(moved.by_op)  # + the scales' vectors


def test_the_experts_padded_cast_equals_the_scatter_and_reads_nothing_back():
    """Each group's amax as a segmented max over its 16-row blocks (groups are contiguous):
    the same fp8 bytes and scales as the atomics of ``scatter_reduce`` and the fp32 cast, empty
    groups included, with no host read; the result column-major (the weight-grad GEMM's
    layouts, cast into place: the count reads its destination too) and 20 bytes moved an
    element against 59."""
    torch.manual_seed(0)
    for trial in range(12):
        counts = torch.randint(0, 40, (5,)).tolist()
        counts[trial % 5] = 0
        counts[(trial + 1) % 5] += 1
        t = torch.randn(sum(counts), 24) * torch.logspace(-20, 20, 24)
        if trial % 3 == 0:
            t[0] = 3e38
        t = t.to(torch.bfloat16 if trial % 2 else torch.float32)
        want, want_scale = _padded_quantize_by_scatter(counts, t)
        groups = PaddedGroups(counts, expert_offsets(counts, t.device))
        with HostSyncRecorder() as rec:
            got, scale = groups.quantize(t)
        assert rec.syncs == [], rec.report()
        assert _same_bits(got, want) and torch.equal(scale, want_scale), counts
        assert got.t().is_contiguous()
    counts = [500, 3, 0, 1200, 777, 300, 700, 616]
    t = torch.randn(sum(counts), 512, dtype=torch.bfloat16)
    groups = PaddedGroups(counts, expert_offsets(counts, t.device))
    with MovedBytes() as before:
        _padded_quantize_by_scatter(counts, t)
    with MovedBytes() as moved:
        groups.quantize(t)
    assert before.total / t.numel() > 55, dict(before.by_op)
    assert moved.total / t.numel() < 20.5, dict(moved.by_op)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "experts"])
def test_only_the_forward_gemm_accumulates_fast(recipe):
    """torchao's float8 defaults: the forward's output GEMM with ``use_fast_accum``, the input
    and weight grad GEMMs without (for the dense linears and the experts alike)."""
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=BF, requires_grad=True)
    if recipe == "experts":
        w = torch.randn(3, 48, 64, dtype=BF, requires_grad=True)
        fn = lambda: fp8_grouped_linear(x, w, [5, 0, 27])  # noqa: E731
    else:
        w = torch.randn(48, 64, dtype=BF, requires_grad=True)
        fn = lambda: _Fp8Linear.apply(x, w, recipe)  # noqa: E731
    with ScaledMatmuls() as mode:
        fn().backward(torch.randn(32, 48, dtype=BF))
    assert mode.fast_accum == [True, False, False]  # forward, input grad, weight grad
    assert list(FAST_ACCUM.values()) == [True, False, False]


@pytest.mark.slow  # ~13 s: dynamo's first import and an aot_eager capture
def test_the_fp8_experts_trace_whole_under_torch_compile():
    """No graph break in the experts' fp8 linear (its forward and backward one graph each,
    the CPU stand-in for the grouped kernel one op): ``trainer.compile`` fuses its casts."""
    torch.manual_seed(0)
    counts = [5, 0, 27]
    x = torch.randn(32, 64, dtype=BF, requires_grad=True)
    w = (torch.randn(3, 48, 64) * 0.05).to(BF).requires_grad_()
    g = torch.randn(32, 48, dtype=BF)
    offsets = expert_offsets(counts, x.device)

    def grads(fn):
        x.grad = w.grad = None
        y = fn(x, w, counts, offsets)
        y.backward(g)
        return y.detach(), x.grad, w.grad

    eager = grads(fp8_grouped_linear)
    try:
        compiled = grads(torch.compile(fp8_grouped_linear, backend="aot_eager", fullgraph=True))
    except torch._dynamo.exc.Unsupported as e:
        raise AssertionError(f"not one graph: {graph_break_reason(e)}") from e
    for a, b in zip(eager, compiled, strict=True):  # the same casts and kernels
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize(
    "counts, k, n",
    [([40, 0, 70, 9], 64, 96), ([300, 5, 100, 1], 160, 32), ([100] * 4, 128, 128)],
)
def test_the_planner_counts_an_fp8_expert_backwards_temporaries(counts, k, n):
    """The most bytes the backward of an fp8 expert linear holds at once (its bf16 and fp8
    copies, the padded groups' indices and scales, its two grads), as a device would hold them
    (kernels' own scratch, like the CPU stand-in's fp32 copies, not counted), against the
    planner's term."""
    torch.manual_seed(0)
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, k, dtype=BF, requires_grad=True)
    w = torch.randn(experts, n, k, dtype=BF, requires_grad=True)
    y = fp8_grouped_linear(x, w, counts)
    g = torch.randn_like(y)
    with PeakLiveBytes() as live:
        y.backward(g)
    padded = sum(padded_size(c) for c in counts)
    planned = fp8_expert_backward_peak(rows, padded, k, n, experts, BF.itemsize)
    assert 0.9 <= planned / live.peak <= 1.1, (planned, live.peak)  # measured 0.96-1.0
