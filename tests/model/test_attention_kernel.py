"""The attention kernel rule (what SDPA runs on CUDA and on a CPU) and that the model follows it.

The table is checked against torch's own admission tests for each CUDA kernel
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` of torch 2.13), written out
independently below, on every combination of its inputs. The rule from torch's runtime checks
(``can_use_*``) is driven with fake answers (flash yes or no, the memory-efficient kernel with
or without grouped-query attention). The model's attention (plain and context-parallel) is run
on CPU with the rule evaluated as on CUDA, and a recording dispatch mode shows the K/V layout
SDPA received.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.context_parallel import attention_kernel as ak
from megatronish.context_parallel.attention import CPContext, cp_causal_attention
from megatronish.distributed.comm import ParallelGroup
from megatronish.model.blocks import Attention
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.testing.runs import test_config as tiny_config

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEAD_DIMS = (64, 80, 128, 200, 240, 256, 6, 36, 320)
CAPABILITIES = ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))


def flash_admits(dtype, mask, head_dim, dropout, capability, grad) -> bool:
    """check_dtypes_flash_attention, check_for_attn_mask, check_head_dim_size_flash,
    check_flash_attention_hardware_support (sm80 on) and
    check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120."""
    if dtype not in (torch.float16, torch.bfloat16) or mask == "tensor" or head_dim > 256:
        return False
    if capability[0] < 8:
        return False
    small_ampere = capability[0] == 8 and capability[1] in (6, 7, 8, 9)
    if grad and (small_ampere or capability[0] == 12):
        return head_dim <= 192 or (dropout == 0 and head_dim > 224)
    return True


def efficient_admits(dtype, gqa, head_dim, capability) -> bool:
    """Its dtypes (bf16 from sm80), minimum_gemm_alignment (sm80 on: 8 in 16-bit, 4 in fp32;
    sm70-75: 8 in fp16, none in fp32), and no GQA (check_batch_size_and_num_heads_dense<false>
    in the torch releases up to 2.13)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if capability >= (8, 0):
        ok_dtype, alignment = half or dtype == torch.float32, 8 if half else 4
    else:
        ok_dtype, alignment = dtype in (torch.float16, torch.float32), 8 if half else 1
    return ok_dtype and head_dim % alignment == 0 and not gqa


CASES = list(itertools.product(DTYPES, (False, True), (0.0, 0.1), ak.MASKS, HEAD_DIMS))


def test_cuda_rule_runs_a_fused_kernel_whenever_expanding_kv_allows_one():
    for (dtype, gqa, dropout, mask, head_dim), cap, grad in itertools.product(
        CASES, CAPABILITIES, (True, False)
    ):
        kernel = ak.attention_kernel("cuda", dtype, gqa, dropout, mask, head_dim, cap, grad)
        case = (dtype, gqa, dropout, mask, head_dim, cap, grad, kernel)
        gqa_seen = gqa and not kernel.expand_kv  # what SDPA's admission tests see
        flash = flash_admits(dtype, mask, head_dim, dropout, cap, grad)
        if kernel.name == "flash":
            assert flash and not kernel.expand_kv, case
        elif kernel.name == "efficient":
            assert efficient_admits(dtype, gqa_seen, head_dim, cap), case
            assert not flash, case  # torch tries flash first
        else:
            assert kernel.name == "math" and not kernel.expand_kv, case
            assert not flash, case
            assert not efficient_admits(dtype, False, head_dim, cap), case  # not even expanded
        assert kernel.expand_kv == (gqa and kernel.name == "efficient"), case  # copies if needed


def test_the_table_knows_where_flash_does_not_run():
    def rule(head_dim, cap, dropout=0.0):
        return ak.attention_kernel("cuda", torch.bfloat16, True, dropout, "causal", head_dim, cap)

    assert rule(256, (9, 0)) == ak.AttentionKernel("flash", expand_kv=False)
    assert rule(200, (8, 6)) == ak.AttentionKernel("efficient", expand_kv=True)  # RTX 3090
    assert rule(256, (12, 0)) == ak.AttentionKernel("flash", expand_kv=False)
    assert rule(256, (12, 0), 0.1) == ak.AttentionKernel("efficient", expand_kv=True)
    assert rule(128, (7, 5)) == ak.AttentionKernel("math", expand_kv=False)  # T4: no bf16
    fp16_t4 = ak.attention_kernel("cuda", torch.float16, True, 0.0, "causal", 128, (7, 5))
    assert fp16_t4 == ak.AttentionKernel("efficient", expand_kv=True)


def test_cpu_keeps_torchs_choice_and_grouped_kv():
    for dtype, gqa, dropout, mask, head_dim in CASES:
        kernel = ak.attention_kernel("cpu", dtype, gqa, dropout, mask, head_dim)
        want = ak.AttentionKernel("cpu_flash" if dropout == 0 else "math", expand_kv=False)
        assert kernel == want, (dtype, gqa, dropout, mask, head_dim)


def test_the_headline_cases():
    def rule(*args):
        kernel = ak.attention_kernel("cuda", *args)
        return kernel.name, kernel.expand_kv

    assert rule(torch.float32, True, 0.0, "causal", 128) == ("efficient", True)
    assert rule(torch.float32, True, 0.1, "lower_right", 128) == ("efficient", True)
    assert rule(torch.float32, False, 0.0, "causal", 128) == ("efficient", False)
    assert rule(torch.bfloat16, True, 0.1, "causal", 128) == ("flash", False)
    assert rule(torch.bfloat16, True, 0.0, "lower_right", 128) == ("flash", False)
    assert rule(torch.bfloat16, True, 0.0, "tensor", 128) == ("efficient", True)
    with pytest.raises(ValueError, match="mask='bool'"):
        rule(torch.float32, True, 0.0, "bool", 128)


class SDPAInputs(TorchDispatchMode):
    """Records the (query heads, key heads, value heads) of every SDPA kernel call."""

    def __init__(self):
        super().__init__()
        self.heads, self.key_storage = [], []  # and the bytes of each call's K storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if "scaled_dot_product" in name and "backward" not in name:
            self.heads.append(tuple(t.shape[1] for t in args[:3]))
            self.key_storage.append(args[1].untyped_storage().nbytes())
        elif name == "aten::_safe_softmax" or name == "aten::_softmax":
            self.heads.append("math")
        return func(*args, **(kwargs or {}))


def _as_on_cuda(monkeypatch):
    """Evaluate the kernel rule for a CUDA device (``monkeypatch.undo()`` restores the CPU's)."""
    rule = ak.attention_kernel
    monkeypatch.setattr(ak, "attention_kernel", lambda device, *a: rule("cuda", *a))


def _attention(dtype):
    torch.manual_seed(0)
    cfg = tiny_config([], 1)  # 8 query heads, 4 K/V heads, head dim 8
    spec = ModelSpec.from_config(cfg.model, 250)
    attn = Attention(spec, TPContext(), CPContext())
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3)
    return attn.to(dtype), spec


def _run(attn, x):
    x = x.detach().clone().requires_grad_()
    with SDPAInputs() as seen:
        out = attn(x, None)
    out.float().square().sum().backward()
    return seen.heads, out, x.grad


@pytest.mark.parametrize("dtype,expanded", [(torch.float32, True), (torch.bfloat16, False)])
def test_model_attention_gives_sdpa_the_kv_layout_of_the_cuda_rule(monkeypatch, dtype, expanded):
    attn, spec = _attention(dtype)
    x = torch.randn(spec.seq_length, 2, spec.hidden_size, dtype=dtype)
    _as_on_cuda(monkeypatch)
    heads, out, grad = _run(attn, x)
    kv = spec.num_heads if expanded else spec.num_kv_heads
    assert heads == [(spec.num_heads, kv, kv)]
    monkeypatch.undo()  # the CPU rule: SDPA's own grouped-query attention
    heads, ref, ref_grad = _run(attn, x)
    assert heads == [(spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)]
    # fp32: two kernels summing in their own orders (grads reach 1e3 here, so an element may
    # differ by 1e-4): equal to round-off of the whole tensor. bf16: the same computation.
    for got, want in ((out, ref), (grad, ref_grad)):
        assert ((got - want).float().norm() <= 1e-6 * want.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cp_attention_gives_sdpa_the_kv_layout_of_the_cuda_rule(monkeypatch, dtype):
    """On a CPU tensor the chunks' mask is a tensor (on CUDA torch's lower-right bias, which
    flash takes in 16-bit): the memory-efficient kernel, K/V expanded, in either precision."""
    torch.manual_seed(0)
    b, heads, kv_heads, s, d, cp = 1, 4, 2, 16, 8, 2
    q = torch.randn(b, heads, s // cp, d, dtype=dtype)
    k, v = torch.randn(2, b, kv_heads, s, d, dtype=dtype)
    ctx = CPContext(group=ParallelGroup("cp", (0, 1), 1), seq_length=s)
    _as_on_cuda(monkeypatch)
    with SDPAInputs() as seen:
        out = cp_causal_attention(q, k, v, ctx, 0.0)
    assert seen.heads == [(heads, heads, heads)] * 2  # one call per local chunk
    # Both chunks read slices of one copy of the whole sequence's K (expanded once a layer).
    assert seen.key_storage == [b * heads * s * d * k.element_size()] * 2
    monkeypatch.undo()
    torch.testing.assert_close(out, cp_causal_attention(q, k, v, ctx, 0.0), rtol=1e-5, atol=1e-6)


def test_expanded_kv_pairs_query_heads_with_their_group():
    x = torch.arange(2 * 3 * 1 * 1.0).view(2, 3, 1, 1)  # 3 K/V heads
    got = ak.expand_kv_heads(x, 6)
    assert got[:, :, 0, 0].tolist() == [[0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5]]
    assert torch.equal(got, x.repeat_interleave(2, dim=1))


# -- the rule from torch's runtime checks, with fake answers -----------------------------------
class FakeCudaTorch:
    """``can_use_*`` answers of a CUDA torch. Flash: 16-bit without a mask tensor (``flash``);
    the memory-efficient kernel: anything (``efficient``), grouped K/V only with
    ``efficient_gqa`` (torch after 2.13). Records what was asked."""

    def __init__(self, flash=True, efficient=True, efficient_gqa=False):
        self.allow = {"flash": flash, "efficient": efficient}
        self.efficient_gqa, self.asked = efficient_gqa, []

    def _grouped(self, p):
        return p.key.shape[1] != p.query.shape[1]

    def flash(self, p):
        self.asked.append(("flash", self._grouped(p)))
        half = p.query.dtype in (torch.float16, torch.bfloat16)
        return self.allow["flash"] and half and p.attn_mask is None

    def efficient(self, p):
        self.asked.append(("efficient", self._grouped(p)))
        grouped_ok = not self._grouped(p) or (p.enable_gqa and self.efficient_gqa)
        return self.allow["efficient"] and grouped_ok

    def checks(self, params=None):
        return ak.SDPAChecks(self.flash, self.efficient, params=params, switches=lambda: ())


def _use_checks(monkeypatch, checks):
    """CPU tensors decided by ``checks``, as CUDA tensors are by torch's."""
    monkeypatch.setattr(ak, "checks_for", lambda device_type: checks)


def _qkv(dtype=torch.float32, heads=4, kv_heads=2, s=8, d=8):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, s, d, generator=gen, dtype=dtype)
    k, v = torch.randn(2, 1, kv_heads, s, d, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "dtype,fake,kernel",
    [
        (torch.bfloat16, {}, ("flash", False)),  # flash takes grouped K/V
        (torch.float32, {}, ("efficient", True)),  # fp32 on torch <= 2.13: expanded
        (torch.float32, {"efficient_gqa": True}, ("efficient", False)),  # later torch
        (torch.bfloat16, {"flash": False}, ("efficient", True)),  # flash refuses (sm75, d > 192)
        (torch.float32, {"efficient": False}, ("math", False)),  # nothing fused: no copies
    ],
)
def test_torchs_checks_decide_the_kv_layout_sdpa_receives(monkeypatch, dtype, fake, kernel):
    torch_ = FakeCudaTorch(**fake)
    _use_checks(monkeypatch, torch_.checks())
    q, k, v = _qkv(dtype)
    assert ak.kernel_for(q, k, v, "causal", is_causal=True) == ak.AttentionKernel(*kernel)
    with SDPAInputs() as seen:
        out = ak.sdpa(q, k, v, "causal", is_causal=True)
    kv = 4 if kernel[1] else 2
    assert seen.heads == [(4, kv, kv)], seen.heads
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # bf16: the same math
    # The expanded layout is asked about only when no fused kernel takes the grouped one.
    expanded_asked = any(not grouped for _, grouped in torch_.asked)
    assert expanded_asked == (kernel[1] or kernel[0] == "math")


def test_the_decision_is_cached_per_layout_mask_and_dropout(monkeypatch):
    torch_ = FakeCudaTorch()
    checks = torch_.checks()
    _use_checks(monkeypatch, checks)
    q, k, v = _qkv()
    for _ in range(3):
        ak.sdpa(q, k, v, "causal", is_causal=True)
    asked = len(torch_.asked)
    assert asked and len(checks.cache) == 1
    ak.kernel_for(q, k, v, "causal", dropout_p=0.1, is_causal=True)
    ak.kernel_for(q, k, v, "none")
    ak.kernel_for(q[:, :, :4], k, v, "lower_right")
    assert len(checks.cache) == 4 and len(torch_.asked) > asked
    with pytest.raises(ValueError, match="mask='bool'"):
        ak.kernel_for(q, k, v, "bool")


def test_lower_right_bias_is_asked_as_torch_applies_it(monkeypatch):
    """Fewer queries than keys: torch's causal bias asks flash and the memory-efficient kernel
    without a mask and not causal; equal lengths: plain causal attention."""
    seen = []
    checks = ak.SDPAChecks(
        lambda p: seen.append((p.attn_mask, p.is_causal)) or False,
        lambda p: False,
        switches=lambda: (),
    )
    q, k, v = _qkv(torch.bfloat16)
    checks.kernel(q[:, :, :4], k, v, "lower_right", None, 0.0, False)
    checks.kernel(q, k, v, "lower_right", None, 0.0, False)
    assert seen[0] == (None, False) and seen[-1] == (None, True)


def test_an_sdpa_params_without_enable_gqa_expands(monkeypatch):
    """A torch whose SDPAParams takes no ``enable_gqa`` has no grouped-query attention in its
    fused kernels: the grouped layout counts as refused, K/V are expanded for the fused one."""

    def six_arguments(*args):
        if len(args) != 6:
            raise TypeError("__init__(): incompatible constructor arguments")
        return torch.backends.cuda.SDPAParams(*args, False)

    torch_ = FakeCudaTorch(efficient_gqa=True)
    _use_checks(monkeypatch, torch_.checks(params=six_arguments))
    q, k, v = _qkv()
    assert ak.kernel_for(q, k, v, "causal", is_causal=True) == ak.AttentionKernel("efficient", True)
    assert torch_.asked == [("flash", False), ("efficient", False)]  # only the expanded layout

    def unknown(*args):
        raise TypeError("__init__(): incompatible constructor arguments")

    _use_checks(monkeypatch, FakeCudaTorch(efficient_gqa=True).checks(params=unknown))
    table = ak.attention_kernel("cuda", torch.float32, True, 0.0, "causal", 8)
    assert ak.kernel_for(q, k, v, "causal", is_causal=True) == table  # none it can build


def test_cp_attention_expands_once_when_torchs_checks_say_so(monkeypatch):
    torch_ = FakeCudaTorch()
    _use_checks(monkeypatch, torch_.checks())
    b, heads, kv_heads, s, d = 1, 4, 2, 16, 8
    q, k, v = _qkv(heads=heads, kv_heads=kv_heads, s=s)
    q = q[:, :, : s // 2]
    ctx = CPContext(group=ParallelGroup("cp", (0, 1), 1), seq_length=s)
    with SDPAInputs() as seen:
        out = cp_causal_attention(q, k, v, ctx, 0.0)
    assert seen.heads == [(heads, heads, heads)] * 2
    assert seen.key_storage == [b * heads * s * d * 4] * 2  # one copy for both chunks
    monkeypatch.undo()
    torch.testing.assert_close(out, cp_causal_attention(q, k, v, ctx, 0.0), rtol=1e-5, atol=1e-6)


def test_torchs_checks_are_used_on_cuda_only():
    assert ak.checks_for("cpu") is None
    if ak.TORCH_CHECKS is not None:  # every torch we support has them
        assert ak.checks_for("cuda") is ak.TORCH_CHECKS
        q, k, v = _qkv()
        assert ak.TORCH_CHECKS.kernel(q, k, v, "causal", None, 0.0, True).name == "math"  # CPU


# -- the planner counts what the rule keeps ---------------------------------------------------
@pytest.fixture(scope="module")
def planned_layer():
    """``planned(device, core=True, **changes)``: the tiny model's (seq 16, micro batch 2, 8
    heads of 8, 4 K/V heads) per-layer bytes and shape, with ModelSpec / Layout fields
    changed."""
    from dataclasses import replace

    from megatronish.plan.dense import layer_bytes, layer_shape
    from megatronish.plan.layout import layout_from_config, spec_of

    cfg = tiny_config([], 1)
    spec, layout = spec_of(cfg), layout_from_config(cfg, 1)

    def planned(device, core=True, **changes):
        s = replace(spec, **{k: v for k, v in changes.items() if hasattr(spec, k)})
        lay = replace(
            layout, device_type=device, **{k: v for k, v in changes.items() if hasattr(layout, k)}
        )
        return layer_bytes(s, lay, core=core), layer_shape(s, lay)

    return planned


def test_the_planner_counts_expanded_kv_and_the_math_kernels_scores_where_the_rule_runs_them(
    planned_layer,
):
    def plan(device, **changes):
        return planned_layer(device, **changes)[0]

    cuda, x = planned_layer("cuda")
    assert cuda - plan("cpu") == 2 * x.b * x.a * x.s * x.d * 4  # fp32 GQA on CUDA: K, V copied
    assert plan("cuda", core=False) == plan("cpu", core=False)  # selective recompute: rebuilt
    assert plan("cuda", num_kv_heads=8) == plan("cpu", num_kv_heads=8)  # nothing to expand
    assert plan("cuda", precision="bf16") == plan("cpu", precision="bf16")  # flash: grouped
    # Attention dropout: the math kernel's scores on a CPU, a fused kernel on CUDA.
    bf16_drop = {"precision": "bf16", "attention_dropout": 0.1}
    assert plan("cuda", **bf16_drop) == plan("cuda", precision="bf16")
    cpu_drop = plan("cpu", **bf16_drop) - plan("cpu", precision="bf16")
    assert cpu_drop == x.b * x.a * x.s * x.s * (2 * 2 + 1)
    # Context parallel: the whole sequence's K and V, expanded once.
    cp_cuda, xc = planned_layer("cuda", cp=2)
    assert cp_cuda - plan("cpu", cp=2) == 2 * xc.b * xc.a * 2 * xc.s * xc.d * 4


def test_the_plan_is_for_the_configured_device():
    from megatronish.plan.layout import layout_from_config

    assert layout_from_config(tiny_config([], 1), 1).device_type == "cpu"  # trainer.device=cpu
    for device in ("auto", "cuda"):  # auto plans for the GPU (a login node has none)
        cfg = tiny_config([f"trainer.device={device}"], 1)
        assert layout_from_config(cfg, 1).device_type == "cuda"


@pytest.mark.parametrize(
    "checks, dtype, expanded",
    [
        ("fake", torch.float32, True),  # torch <= 2.13: the memory-efficient kernel, expanded
        ("fake", torch.bfloat16, False),  # flash takes grouped K/V
        ("torch's", torch.float32, None),  # the real SDPAParams and can_use_* (on CPU tensors)
    ],
)
def test_compiled_attention_is_one_graph_with_the_checks_asked_while_tracing(
    monkeypatch, checks, dtype, expanded
):
    """torch's checks cannot be traced (``storage_offset``, ``SDPAParams``, ``can_use_*``): under
    torch.compile the K/V layout is decided once, while tracing, and the block stays one graph
    (fullgraph) on CUDA as on CPU, with the layout eager attention would give SDPA."""
    torch_ = FakeCudaTorch()
    sdpa_checks = torch_.checks() if checks == "fake" else ak.TORCH_CHECKS
    _use_checks(monkeypatch, sdpa_checks)
    q, k, v = (t.requires_grad_() for t in _qkv(dtype))
    eager = ak.sdpa(q, k, v, "causal", is_causal=True)
    asked = len(torch_.asked)
    sdpa_checks.cache.clear()  # asked again while tracing
    graphs = []

    def recorded(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(
        lambda q, k, v: ak.sdpa(q, k, v, "causal", is_causal=True),
        backend=recorded,
        fullgraph=True,
    )
    out = compiled(q, k, v)
    compiled(q, k, v)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1
    if checks == "fake":
        assert (".expand(" in graphs[0]) == expanded, graphs[0]
        assert len(torch_.asked) == 2 * asked  # once more, while tracing; not per call


def test_a_compiled_block_of_grouped_query_attention_is_captured_whole(monkeypatch):
    """The model's compile (whole first, in pieces where dynamo cannot capture the block) keeps
    attention whole: the K/V layout is not asked of torch's checks inside the traced graph."""
    from megatronish.model.compile import CompiledForward

    _use_checks(monkeypatch, FakeCudaTorch().checks())

    class Block(nn.Module):
        def forward(self, q, k, v):
            return ak.sdpa(q, k, v, "causal", is_causal=True)

    q, k, v = _qkv()
    logged = []
    compiled = CompiledForward("block 0", Block(), "eager", logged.append, {})
    out = compiled(q, k, v)
    assert compiled.fullgraph and logged == [], logged
    torch.testing.assert_close(out, ak.sdpa(q, k, v, "causal", is_causal=True))
