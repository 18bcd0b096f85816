"""The grouped experts: equal to a per-expert loop (both implementations: torch's grouped matmul
and our loop), and a backward whose allocations do not grow with the number of local experts."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.moe.experts import GroupedExperts
from megatronish.moe.grouped_mm import (
    ALIGN_BYTES,
    expert_offsets,
    grouped_linear,
    grouped_mm_supported,
    torch_version,
    use_grouped_mm,
)
from megatronish.spec import ModelSpec, MoESpec
from megatronish.tensor_parallel.weight_grad import WeightGradStore
from megatronish.testing.allocations import AllocatedBytes

HAS_GROUPED_MM = use_grouped_mm("cpu", torch.float32, torch_version())
# True: torch's grouped matmul, False: our per-expert loop.
PATHS = [
    pytest.param(
        True,
        id="grouped_mm",
        marks=pytest.mark.skipif(
            not HAS_GROUPED_MM, reason=f"torch {torch.__version__} has no CPU grouped_mm (< 2.9)"
        ),
    ),
    pytest.param(False, id="loop"),
]


def experts_of(arch: str, local: int, hidden: int, ffn: int, grouped, dtype=torch.float32):
    moe = MoESpec(num_experts=local, top_k=1, layer_freq=1, ffn_hidden_size=ffn)
    spec = ModelSpec(
        arch=arch,
        num_layers=2,
        hidden_size=hidden,
        num_heads=2,
        num_kv_heads=2,
        ffn_hidden_size=ffn,
        seq_length=8,
        vocab_size=64,
        padded_vocab_size=128,
        max_position_embeddings=8,
        moe=moe,
    )
    experts = GroupedExperts(spec, 1, local, 0, grouped=grouped).to(dtype)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(local)
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return experts


def per_expert_loop(experts: GroupedExperts, rows: torch.Tensor, counts: list[int]):
    """The experts written out one at a time, as the block computed them before."""
    outputs, start = [], 0
    for e, n in enumerate(counts):
        y = F.linear(rows[start : start + n], experts.fc1[e])
        if experts.llama:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        outputs.append(F.linear(y, experts.fc2[e]))
        start += n
    return torch.cat(outputs)


def grads_of(fn, experts, rows, upstream):
    """Output and the grads of the rows and both stacks, ``upstream`` None: ``out.sum()``
    (an expanded, stride-0 incoming gradient)."""
    experts.zero_grad(set_to_none=True)
    x = rows.detach().clone().requires_grad_()
    out = fn(x)
    (out.sum() if upstream is None else out).backward(upstream)
    return [out.detach(), x.grad, experts.fc1.grad, experts.fc2.grad]


@pytest.mark.parametrize("grouped", PATHS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("counts", [[5, 0, 7, 8], [0, 0, 20, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("expanded", [False, True], ids=["dense_grad", "expanded_grad"])
def test_experts_equal_a_per_expert_loop(grouped, arch, counts, expanded):
    experts = experts_of(arch, 4, 16, 12, grouped)
    rows = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(3))
    upstream = None if expanded else torch.randn(sum(counts), 16)
    got = grads_of(lambda x: experts(x, counts), experts, rows, upstream)
    want = grads_of(lambda x: per_expert_loop(experts, x, counts), experts, rows, upstream)
    for a, b in zip(got, want, strict=True):  # two kernels: fp32 round-off, not bit identity
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for e in (e for e, n in enumerate(counts) if n == 0):
        assert not got[2][e].any() and not got[3][e].any()  # no tokens, no grad


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch < 2.9 has no CPU grouped_mm")
def test_bf16_grouped_mm_tracks_fp32():
    """bf16 takes torch's grouped matmul too (sizes are multiples of 8), within bf16 round-off
    of the fp32 experts."""
    counts = [6, 0, 10, 16]
    want_experts = experts_of("llama", 4, 16, 24, None)
    experts = experts_of("llama", 4, 16, 24, None, torch.bfloat16)
    rows = torch.randn(32, 16, generator=torch.Generator().manual_seed(4))
    assert grouped_mm_supported(rows.bfloat16(), experts.fc1, counts)
    got = grads_of(lambda x: experts(x, counts), experts, rows.bfloat16(), None)
    want = grads_of(lambda x: want_experts(x, counts), want_experts, rows, None)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.02)


def test_given_offsets_and_wrong_counts():
    experts = experts_of("llama", 4, 16, 12, None)
    rows, counts = torch.randn(20, 16), [5, 0, 7, 8]
    offsets = expert_offsets(counts, rows.device)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [5, 5, 12, 20]
    torch.testing.assert_close(experts(rows, counts, offsets), experts(rows, counts))
    with pytest.raises(ValueError, match="20 rows do not split into"):
        experts(rows, [5, 0, 7, 7])
    with pytest.raises(ValueError, match="for 4 experts"):
        grouped_linear(rows, experts.fc1, [10, 10])


def test_where_grouped_mm_is_used():
    """CPU wherever torch has it; CUDA only where it is one grouped kernel (bf16 on 9.x/10.x),
    not its fallback that copies the offsets to the host (ExpertLoop needs no sync)."""
    fp32, bf16 = torch.float32, torch.bfloat16
    assert not use_grouped_mm("cpu", fp32, (2, 8))  # 2.8: CUDA only
    assert use_grouped_mm("cpu", fp32, (2, 9)) and use_grouped_mm("cpu", bf16, (3, 0))
    assert not use_grouped_mm("cpu", torch.float64, (2, 13))
    assert not use_grouped_mm("cuda", bf16, (2, 7), (9, 0))  # absent before 2.8
    assert use_grouped_mm("cuda", bf16, (2, 8), (9, 0))
    assert use_grouped_mm("cuda", bf16, (2, 11), (9, 0))
    assert not use_grouped_mm("cuda", bf16, (2, 8), (10, 0))  # 2.8: Hopper only
    assert use_grouped_mm("cuda", bf16, (2, 9), (10, 0))
    assert not use_grouped_mm("cuda", fp32, (2, 11), (9, 0))  # fallback: a host sync per call
    assert not use_grouped_mm("cuda", bf16, (2, 11), (8, 0))
    assert not use_grouped_mm("cuda", bf16, (2, 11), (12, 0))
    assert not use_grouped_mm("cuda", bf16, (2, 11), (9, 0), rocm=True)
    assert not use_grouped_mm("mps", fp32, (2, 13))
    assert torch_version("2.11.0+cu130") == (2, 11) and torch_version("2.9.0a0+git1") == (2, 9)
    # Shapes: every row of every operand a multiple of 16 bytes; some rows to multiply.
    x, w, counts = torch.empty(8, 16), torch.empty(4, 24, 16), [2, 2, 2, 2]
    assert grouped_mm_supported(x, w, counts) == HAS_GROUPED_MM
    assert not grouped_mm_supported(x.to(bf16), torch.empty(4, 12, 16, dtype=bf16), counts)
    assert not grouped_mm_supported(torch.empty(8, 6), torch.empty(4, 24, 6), counts)
    assert not grouped_mm_supported(torch.empty(0, 16), w, [0, 0, 0, 0])
    unaligned = torch.empty(w.numel() + 1)[1:].view_as(w)  # a stack 4 bytes off 16
    assert not grouped_mm_supported(x, unaligned, counts)


class GroupedMatmuls(TorchDispatchMode):
    """Counts ``torch._grouped_mm`` calls, holding each operand to torch's layout rule first:
    16-byte aligned, row- or column-major in its last two dims with 16-byte multiple rows (an
    expanded, stride-0 gradient is neither)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] == "_grouped_mm":
            self.calls += 1
            for t in args[:2]:
                *_, rows, cols = t.stride()
                step = t.element_size()
                major = (cols == 1 and rows * step % ALIGN_BYTES == 0 and rows >= t.shape[-1]) or (
                    rows == 1 and cols * step % ALIGN_BYTES == 0 and cols >= t.shape[-2]
                )
                assert major and t.data_ptr() % ALIGN_BYTES == 0, (tuple(t.shape), t.stride())
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch < 2.9 has no CPU grouped_mm")
@pytest.mark.parametrize("split", [False, True], ids=["torchs_backward", "split_backward"])
def test_an_expanded_output_grad_reaches_the_grouped_matmuls_laid_out(split):
    """A ``sum``'s gradient is expanded (stride 0): both backwards (torch's for
    ``torch._grouped_mm``, ours with a store) hand its grouped matmuls a contiguous copy."""
    counts = [5, 0, 7, 4]
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    store = WeightGradStore() if split else None
    with GroupedMatmuls() as mode:
        grouped_linear(x, w, counts, grouped=True, store=store).sum().backward()
    assert mode.calls == 3  # the forward, the input grad and the stack's grad
    assert x.grad is not None and w.grad is not None


def backward_bytes(local: int, grouped) -> tuple[int, int]:
    """Bytes the experts' backward allocates for 512 rows (h 64, ffn 64) spread over ``local``
    experts, and the bytes of the two stacks' grads among them."""
    experts = experts_of("llama", local, 64, 64, grouped)
    counts = [512 // local] * local
    rows = torch.randn(512, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    out = experts(rows, counts)
    upstream = torch.randn_like(out)
    with AllocatedBytes() as counted:
        out.backward(upstream)
    stacks = sum(p.grad.numel() * p.grad.element_size() for p in experts.parameters())
    return counted.total, stacks


@pytest.mark.parametrize("grouped", PATHS)
def test_backward_allocations_do_not_grow_with_local_experts(grouped):
    """From 4 to 64 local experts at the same rows and sizes, the backward allocates the
    stacks' grads (16x larger) and otherwise about the same: no per-expert tensor the size of
    the input or of a whole stack (a slice or an index of the stack per expert would)."""
    total4, stacks4 = backward_bytes(4, grouped)
    total64, stacks64 = backward_bytes(64, grouped)
    assert stacks64 == 16 * stacks4 and total4 >= stacks4 and total64 >= stacks64
    assert total64 - stacks64 < 1.5 * (total4 - stacks4), (total4, stacks4, total64, stacks64)
