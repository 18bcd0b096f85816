"""Which fused attention kernel SDPA runs, and the K/V layout that lets it run one.

SDPA runs flash attention, cuDNN attention or the memory-efficient kernel when one admits the
inputs, else the math kernel, which materialises ``[b, heads, s, keys]`` scores and keeps them
for backward. Grouped-query attention (fewer K/V heads than query heads, ``enable_gqa``) is
taken natively by flash and cuDNN attention, and by the memory-efficient kernel only in torch
releases after 2.13 (pytorch#191085; 2.13's own checks still refuse it). Where no fused kernel
takes the grouped K and V but one takes them copied to the query heads (``[b, heads, keys,
d]``, far less than the scores), they are copied first: fp32 grouped-query attention on torch
<= 2.13, for instance. Everywhere else K and V stay grouped (a copy would only add the saved
``[b, heads, keys, d]`` tensors).

On CUDA the decision asks torch's own admission tests, ``torch.backends.cuda.
can_use_flash_attention`` / ``can_use_cudnn_attention`` / ``can_use_efficient_attention`` with
the :class:`torch.backends.cuda.SDPAParams` SDPA builds (so the GPU, the torch version, the
backends the user turned off and deterministic mode all count), once per shape, dtype, layout,
mask kind and dropout (:class:`SDPAChecks`). :func:`attention_kernel` is the same rule as a
table, written from torch 2.13's ``sdp_utils.cpp``: the fallback where torch lacks those
checks, the planner's view (:mod:`megatronish.plan.dense`), and the CPU's rule (torch's
flash kernel without dropout, the math kernel with it; K and V stay grouped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)
MASKS = ("causal", "lower_right", "tensor", "none")
CACHE_ENTRIES = 256  # decisions kept per SDPAChecks (generation adds one per new length)


@dataclass(frozen=True)
class AttentionKernel:
    """The kernel SDPA will run and whether K/V are expanded to the query heads for it."""

    name: str  # "flash", "cudnn", "efficient", "math" (CUDA) or "cpu_flash", "math" (CPU)
    expand_kv: bool


# -- the rule as a table ----------------------------------------------------------------------
def _flash_admits(
    dtype: torch.dtype,
    mask: str,
    head_dim: int,
    dropout: float,
    capability: tuple[int, int],
    requires_grad: bool,
) -> bool:
    """check_dtypes_flash_attention, check_for_attn_mask, check_head_dim_size_flash,
    check_flash_attention_hardware_support and the training limit on sm86/89/120/121."""
    if dtype not in HALF or mask == "tensor" or head_dim > 256 or capability < (8, 0):
        return False
    if requires_grad and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)):
        return head_dim <= 192 or (dropout == 0 and head_dim > 224)
    return True


def _efficient_admits(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> bool:
    """Its dtypes (bf16 from sm80) and head dims (minimum_gemm_alignment)."""
    sm80 = capability >= (8, 0)
    if dtype not in (torch.float16, torch.float32, *((torch.bfloat16,) if sm80 else ())):
        return False
    half = dtype in HALF
    tensor_cores = sm80 or (capability >= (7, 0) and half)
    alignment = max(4 if sm80 else 1, (8 if half else 4) if tensor_cores else 1)
    return capability >= (5, 0) and head_dim % alignment == 0


def attention_kernel(
    device_type: str,
    dtype: torch.dtype,
    gqa: bool,
    dropout: float,
    mask: str,
    head_dim: int,
    capability: tuple[int, int] = (9, 0),
    requires_grad: bool = True,
) -> AttentionKernel:
    """The SDPA kernel for these inputs by the table (torch <= 2.13: no grouped-query attention
    in the memory-efficient kernel; cuDNN attention left out). ``gqa``: fewer K/V heads than
    query heads; ``mask``: "causal" (``is_causal``), "lower_right" (torch's causal bias for
    fewer queries than keys), "tensor" (an additive mask) or "none"; ``capability``: the CUDA
    GPU's (major, minor)."""
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} is not one of {MASKS}")
    if device_type != "cuda":
        return AttentionKernel("cpu_flash" if dropout == 0 else "math", expand_kv=False)
    if _flash_admits(dtype, mask, head_dim, dropout, capability, requires_grad):
        return AttentionKernel("flash", expand_kv=False)
    if _efficient_admits(dtype, head_dim, capability):
        return AttentionKernel("efficient", expand_kv=gqa)
    return AttentionKernel("math", expand_kv=False)


# -- the rule from torch's own checks ---------------------------------------------------------
def _sdp_switches() -> tuple:
    """The global settings torch's checks read besides the tensors."""
    cuda = torch.backends.cuda
    cudnn = getattr(cuda, "cudnn_sdp_enabled", lambda: False)
    return (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cudnn(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _layout(t: torch.Tensor) -> tuple:
    """What the checks read of a tensor: shape, strides, alignment of its start (16 bytes is
    the most any kernel needs), grad."""
    offset = t.storage_offset() * t.element_size() % 16
    return tuple(t.shape), t.stride(), offset, t.requires_grad


class SDPAChecks:
    """SDPA's kernel admission tests (``can_use_*(SDPAParams) -> bool``), and the K/V layout
    decision made from them, cached per inputs' layout, mask kind and dropout.

    ``params`` builds an ``SDPAParams`` from seven positional arguments (query, key, value,
    mask, dropout, is_causal, enable_gqa), as torch 2.13 and its torch.compile support build it;
    where that raises TypeError (an SDPAParams from before ``enable_gqa``) it gets the first
    six, and grouped K/V count as refused; where neither works the table decides.
    ``switches``: the global settings the checks also read.
    """

    def __init__(
        self,
        flash: Callable,
        efficient: Callable,
        cudnn: Callable | None = None,
        params: Callable | None = None,
        switches: Callable[[], tuple] = _sdp_switches,
    ):
        self.flash, self.efficient, self.cudnn = flash, efficient, cudnn
        self.params = params if params is not None else torch.backends.cuda.SDPAParams
        self.switches = switches
        self.cache: dict = {}

    def _params(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout: float,
        is_causal: bool,
        gqa: bool,
    ) -> torch.backends.cuda.SDPAParams | None:
        try:
            return self.params(q, k, v, attn_mask, dropout, is_causal, gqa)
        except TypeError:  # an SDPAParams without enable_gqa
            return None if gqa else self.params(q, k, v, attn_mask, dropout, is_causal)

    def _fused(self, params: torch.backends.cuda.SDPAParams | None, bias: bool) -> str | None:
        """The first fused kernel that admits ``params`` (torch's causal bias tries flash and
        the memory-efficient kernel only)."""
        if params is None:
            return None
        kernels = [
            ("flash", self.flash),
            ("cudnn", None if bias else self.cudnn),
            ("efficient", self.efficient),
        ]
        return next((name for name, can_use in kernels if can_use and can_use(params)), None)

    def kernel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: str,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
    ) -> AttentionKernel:
        """The kernel for these inputs and whether K/V must be expanded for it."""
        extra = () if mask != "tensor" else (attn_mask.dtype, _layout(attn_mask))
        key = (
            q.dtype,
            q.device,
            _layout(q),
            _layout(k),
            _layout(v),
            mask,
            extra,
            float(dropout_p),
            bool(is_causal),
            torch.is_grad_enabled(),
            self.switches(),
        )
        hit = self.cache.get(key)
        if hit is None:
            try:
                hit = self._decide(q, k, v, mask, attn_mask, dropout_p, is_causal)
            except TypeError:  # an SDPAParams this module cannot build: the table
                hit = _by_table("cuda", q, k, v, mask, dropout_p)
            if len(self.cache) >= CACHE_ENTRIES:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = hit
        return hit

    def _decide(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: str,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
    ) -> AttentionKernel:
        # What SDPA hands its checks: torch's lower-right causal bias checks without a mask and
        # not causal when the queries are fewer than the keys (it then applies the bias itself),
        # and is plain is_causal attention otherwise.
        bias = mask == "lower_right" and q.shape[-2] != k.shape[-2]
        if mask == "lower_right":
            attn_mask, is_causal = None, not bias
        elif mask != "tensor":
            attn_mask = None
        heads = q.shape[1]
        gqa = k.shape[1] != heads
        name = self._fused(self._params(q, k, v, attn_mask, dropout_p, is_causal, gqa), bias)
        if name is not None or not gqa:
            return AttentionKernel(name or "math", expand_kv=False)

        def expanded(t: torch.Tensor) -> torch.Tensor:
            # expand_kv_heads' layout, uninitialised: once per cached decision
            shape = (t.shape[0], heads, *t.shape[2:])
            return torch.empty(shape, dtype=t.dtype, device=t.device).requires_grad_(
                t.requires_grad
            )

        params = self._params(q, expanded(k), expanded(v), attn_mask, dropout_p, is_causal, False)
        name = self._fused(params, bias)
        return AttentionKernel(name, expand_kv=True) if name else AttentionKernel("math", False)


def torch_checks() -> SDPAChecks | None:
    """:class:`SDPAChecks` on torch's own tests, or None where this torch lacks them."""
    cuda = torch.backends.cuda
    names = ("can_use_flash_attention", "can_use_efficient_attention", "SDPAParams")
    if not all(hasattr(cuda, n) for n in names):
        return None
    return SDPAChecks(
        cuda.can_use_flash_attention,
        cuda.can_use_efficient_attention,
        getattr(cuda, "can_use_cudnn_attention", None),
    )


TORCH_CHECKS = torch_checks()


def checks_for(device_type: str) -> SDPAChecks | None:
    """The admission tests for tensors on ``device_type``: torch's on CUDA, none elsewhere (the
    table decides). Tests replace this to drive the rule with fake answers."""
    return TORCH_CHECKS if device_type == "cuda" else None


@lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def kernel_for(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: str,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> AttentionKernel:
    """The kernel SDPA runs for these ``[b, heads, s, d]`` queries and ``[b, kv_heads, keys,
    d]`` keys/values, and whether K/V are to be expanded to the query heads for it (``mask``:
    see :func:`attention_kernel`): torch's own checks where :func:`checks_for` has them, else
    the table."""
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} is not one of {MASKS}")
    checks = checks_for(q.device.type)
    if checks is not None:
        return checks.kernel(q, k, v, mask, attn_mask, dropout_p, is_causal)
    return _by_table(q.device.type, q, k, v, mask, dropout_p)


def _by_table(
    device_type: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: str,
    dropout_p: float,
) -> AttentionKernel:
    """:func:`attention_kernel` for these tensors, as if on ``device_type``."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return attention_kernel(
        device_type,
        q.dtype,
        k.shape[1] != q.shape[1],
        dropout_p,
        mask,
        q.shape[-1],
        _capability(q.device),
        grad,
    )


def expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` ``[b, kv_heads, s, d]`` copied to ``[b, heads, s, d]``: query head ``i`` gets K/V
    head ``i // (heads / kv_heads)``, as SDPA's ``enable_gqa`` pairs them."""
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, heads // kv, s, d).reshape(b, heads, s, d)


TensorSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, bool]  # shape, strides, ...


def _spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


def expand_kv_of(
    device: torch.device,
    q: TensorSpec,
    k: TensorSpec,
    v: TensorSpec,
    attn_mask: TensorSpec | None,
    mask: str,
    dropout_p: float,
    is_causal: bool,
    grad_enabled: bool,
) -> bool:
    """:func:`kernel_for`'s ``expand_kv`` for tensors described by their shape, strides, dtype
    and ``requires_grad`` (uninitialised ones of that layout are asked about). Under
    ``torch.compile`` dynamo calls it once while tracing and keeps the answer as a constant of
    the graph (it is marked as ``torch._dynamo.assume_constant_result`` marks a function): the
    checks themselves (``storage_offset``, ``SDPAParams``, ``can_use_*``) cannot be traced."""

    def like(spec: TensorSpec | None) -> torch.Tensor | None:
        if spec is None:
            return None
        shape, stride, dtype, grad = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)

    with torch.set_grad_enabled(grad_enabled):
        args = like(q), like(k), like(v)
        return kernel_for(*args, mask, like(attn_mask), dropout_p, is_causal).expand_kv


# What torch._dynamo.assume_constant_result sets, without importing dynamo at start-up.
expand_kv_of._dynamo_marked_constant = True


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: str,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``[b, heads, s, d]`` queries and ``[b, kv_heads,
    s_k, d]`` keys/values, laid out for the kernel :func:`kernel_for` picks (under
    ``torch.compile``: :func:`expand_kv_of`, decided once per graph)."""
    heads = q.shape[1]
    gqa = k.shape[1] != heads
    if gqa and torch.compiler.is_compiling():
        specs = _spec(q), _spec(k), _spec(v), _spec(attn_mask)
        grad = torch.is_grad_enabled()
        expand = expand_kv_of(q.device, *specs, mask, float(dropout_p), bool(is_causal), grad)
    else:
        expand = gqa and kernel_for(q, k, v, mask, attn_mask, dropout_p, is_causal).expand_kv
    if expand:
        k, v, gqa = expand_kv_heads(k, heads), expand_kv_heads(v, heads), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=gqa
    )
