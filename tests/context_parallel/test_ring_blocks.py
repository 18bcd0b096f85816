"""Ring attention's blocks as CUDA runs them, proved on CPU: the plain-matmul kernel in query
tiles (packed documents on CUDA), grouped K/V handed to the flash kernel where SDPA's rule
takes them, and dK/dV accumulated in fp32 across the ring's hops."""

import pytest
import torch
import torch.nn.functional as F

from megatronish.context_parallel import attention_kernel as ak
from megatronish.context_parallel import ring_kernel as rk
from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.ring import ring_attention
from megatronish.context_parallel.split import split_sequence
from megatronish.testing.multiproc import run_world


def _qkv(b=2, heads=4, kv_heads=2, sq=24, sk=24, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, sq, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, sk, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, sk, d, generator=g).to(dtype)
    return q, k, v


def _documents(b: int, sq: int, sk: int, offset: int) -> rk.BlockDocuments:
    """Queries at positions ``offset ..`` against keys ``0 .. sk``; documents of 5 tokens in
    sample 0, 7 in sample 1 (some rows see no key when ``offset`` > 0)."""
    ids = torch.stack([torch.arange(offset + sq) // 5, torch.arange(offset + sq) // 7])[:b]
    q_pos, k_pos = torch.arange(offset, offset + sq), torch.arange(sk)
    return rk.BlockDocuments(ids[:, q_pos], ids[:, k_pos], q_pos, k_pos)


@pytest.mark.parametrize("case", ["causal", "documents", "documents-later", "mask"])
def test_the_math_kernel_in_tiles_equals_it_in_one_piece_and_the_cpu_kernel(case):
    """Three rows at a time (a tile budget of three rows' scores) or all at once, the plain
    matmul kernel gives the same output, log-sum-exp and grads, and the CPU flash kernel's;
    document rows that see no key get output 0 and log-sum-exp -inf from the math kernel
    itself."""
    q, k, v = _qkv(sk=24 if case != "documents-later" else 16)
    causal = case == "causal"
    documents = None
    mask = None
    if case.startswith("documents"):
        documents = _documents(2, 24, k.shape[2], 0 if case == "documents" else 30)
    if case == "mask":
        mask = torch.zeros(2, 1, 24, 24).masked_fill_(torch.rand(2, 1, 24, 24) < 0.3, -1e4)
    three_rows = 2 * 4 * 3 * k.shape[2] * 4
    assert rk.math_tile_rows(2, 4, 24, k.shape[2], three_rows) == 3
    whole = rk.math_block_attention(q, k, v, causal, mask, documents)
    tiled = rk.math_block_attention(q, k, v, causal, mask, documents, tile_bytes=three_rows)
    fused = rk.block_attention(q, k, v, causal, mask, documents)  # the CPU kernel
    for got in (tiled, fused):
        torch.testing.assert_close(got.out, whole.out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.lse, whole.lse, atol=1e-5, rtol=1e-5)
    if case == "documents-later":
        unseen = torch.isneginf(whole.lse)
        assert unseen.any() and (whole.out[unseen] == 0).all()
    # backward with a merged output and log-sum-exp every row has (as the ring's)
    lse = torch.logaddexp(whole.lse, torch.zeros_like(whole.lse))
    out, dout = whole.out * 0.5, torch.randn_like(q)
    want = rk.math_block_backward(dout, q, k, v, out, lse, causal, mask, documents)
    got = rk.math_block_backward(dout, q, k, v, out, lse, causal, mask, documents, three_rows)
    cpu = rk.block_backward(dout, q, k, v, out, lse, causal, (), mask, documents)
    for a, b, c in zip(got, want, cpu, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, b, atol=1e-5, rtol=1e-5)


def _as_on_cuda(monkeypatch):
    """The ring's kernel rule evaluated as on CUDA (document-masked blocks: the math kernel,
    which runs on CPU too)."""
    rule = rk.block_kernel
    monkeypatch.setattr(rk, "block_kernel", lambda device, *a, **kw: rule("cuda", *a, **kw))


def _reference(q, k, v, ids):
    """Causal attention within documents over the whole sequence (expanded K/V, fp32)."""
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    visible = (ids[:, :, None] == ids[:, None, :]) & causal
    groups = q.shape[1] // k.shape[1]
    kx, vx = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, kx, vx, attn_mask=visible.unsqueeze(1))


def _ring_rank(rank, world, whole, dout, ids, dtype, cuda_rule, tile_bytes):
    from megatronish.distributed.topology import Topology

    if cuda_rule:
        rule = rk.block_kernel
        rk.block_kernel = lambda device, *a, **kw: rule("cuda", *a, **kw)
    if tile_bytes is not None:
        rk.MATH_TILE_BYTES = tile_bytes
    calls = []
    math = rk.math_block_backward
    rk.math_block_backward = lambda *a, **kw: calls.append(1) or math(*a, **kw)
    topo = Topology.build(tp=1, cp=world, dp=1, pp=1, rank=rank)
    cp = CPContext(group=topo.cp_group, seq_length=whole[0].shape[2], comm_type="ring")
    mine = [split_sequence(t, 2, world, rank).to(dtype).requires_grad_() for t in whole]
    documents = None if ids is None else Documents(ids=ids)
    out = ring_attention(*mine, cp, documents)
    out.backward(split_sequence(dout, 2, world, rank).to(dtype))
    return out.detach().float(), [t.grad.float() for t in mine], len(calls)


def _gather(parts: list[torch.Tensor], world: int) -> torch.Tensor:
    """The whole sequence (dim 2) from every rank's two chunks."""
    chunks = [None] * (2 * world)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=2)
        chunks[rank], chunks[2 * world - 1 - rank] = first, second
    return torch.cat(chunks, dim=2)


@pytest.mark.parametrize("cp", [2, 4])
def test_document_masked_ring_blocks_on_the_cuda_rule_run_the_math_kernel_in_tiles(cp):
    """Packed documents under CUDA's kernel rule (bf16 blocks there run the math kernel; here
    fp32 so the result is held to fp32 round-off) with tiles of a few rows: the ring's output
    and grads equal attention within documents over the whole sequence, and every block's
    backward ran the math kernel."""
    s = 8 * cp
    whole = _qkv(b=2, sq=s, sk=s, seed=1)
    dout = torch.randn_like(whole[0])
    ids = torch.stack([torch.arange(s) // 5, torch.arange(s) // 11])
    leaves = [t.clone().requires_grad_() for t in whole]
    want = _reference(*leaves, ids)
    want.backward(dout)
    tile = 2 * 4 * 3 * (2 * s // (2 * cp)) * 4  # three rows of the largest block's scores
    results = run_world(_ring_rank, cp, whole, dout, ids, torch.float32, True, tile)
    assert all(calls == cp for _, _, calls in results)  # one math backward per block
    torch.testing.assert_close(_gather([r[0] for r in results], cp), want.detach())
    for i, leaf in enumerate(leaves):
        got = _gather([r[1][i] for r in results], cp)
        torch.testing.assert_close(got, leaf.grad, atol=1e-5, rtol=1e-5)


def _share(rank: int, owner: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A block's synthetic fp32 dK|dV share from ``rank``: ``1 + m / 4096``, ``m`` an integer
    below 64 (any sum of 8 of them is exact in fp32)."""
    g = torch.Generator().manual_seed(100 * rank + owner)
    return 1 + torch.randint(0, 64, shape, generator=g).float() / 4096


def _accumulate_rank(rank, world):
    from megatronish.context_parallel import ring
    from megatronish.distributed.topology import Topology

    def shares(q, kv, kv_heads, dout, out, lse, part, dq, masked, extra):
        owner = (rank - len(seen)) % world  # ring_owner: the block held at this step
        seen.append(owner)
        return _share(rank, owner, tuple(kv.shape))

    seen: list[int] = []
    ring._block_grads = shares
    topo = Topology.build(tp=1, cp=world, dp=1, pp=1, rank=rank)
    cp = CPContext(group=topo.cp_group, seq_length=8 * world, comm_type="ring")
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, sq=8, sk=8, dtype=torch.bfloat16))
    ring_attention(q, k, v, cp).sum().backward()
    return torch.cat([k.grad, v.grad], dim=1).float()


def test_the_ring_rounds_its_dk_dv_accumulators_once():
    """bf16 over a ring of 8, each rank's share of every block's dK|dV a synthetic fp32 tensor:
    a block's dK|dV arrives home within half a bf16 step of the fp32 sum of its 8 shares, what
    rounding once allows. An accumulator rounded to bf16 at every hop drifts further (its
    sums between 1 and 8 rounded seven times)."""
    cp = 8
    got = run_world(_accumulate_rank, cp)
    shape = tuple(got[0].shape)
    for owner in range(cp):
        total = sum(_share(r, owner, shape) for r in range(cp))  # in [8, 8.125): steps of 1/16
        error = (got[owner] - total).abs().max().item()
        assert error <= 2**-5, (owner, error)


class _FakeFlash:
    """Stand-ins for ATen's CUDA flash ops: the math kernel (which takes grouped K/V as the
    flash kernel does), recording the kv heads each call received."""

    def __init__(self):
        self.kv_heads: list[int] = []
        self._scaled_dot_product_flash_attention_for_cpu = None

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout, causal):
        self.kv_heads.append(k.shape[1])
        block = rk.math_block_attention(q, k, v, causal)
        return block.out, block.lse, None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_flash_attention_backward(
        self, dout, q, k, v, out, lse, cum_q, cum_k, sq, sk, dropout, causal, seed, offset
    ):
        self.kv_heads.append(k.shape[1])
        return rk.math_block_backward(dout, q, k, v, out, lse, causal)


class _Checks:
    """SDPA's admission tests answering ``flash`` for grouped K/V, yes for equal heads."""

    def __init__(self, grouped: bool):
        self.grouped = grouped

    def checks(self) -> ak.SDPAChecks:
        def flash(params) -> bool:
            q, k = params[0], params[1]
            return self.grouped or k.shape[1] == q.shape[1]

        return ak.SDPAChecks(flash, lambda p: False, params=lambda *a: a)


@pytest.mark.parametrize("grouped", [True, False])
def test_the_cuda_flash_block_takes_grouped_kv_where_sdpas_rule_does(monkeypatch, grouped):
    """On CUDA's rule (bf16, no mask: the flash kernel) the block hands the kernel K/V with
    their 2 kv heads where torch's checks admit flash on grouped K/V, copies them to the 4
    query heads where they do not; forward and backward decide alike (the forward's extras
    carry it) and the grads are the kv heads' either way."""
    q, k, v = _qkv(dtype=torch.bfloat16)
    fake = _FakeFlash()
    _as_on_cuda(monkeypatch)
    monkeypatch.setattr(rk, "aten", fake)
    monkeypatch.setattr(ak, "checks_for", lambda device_type: _Checks(grouped).checks())
    assert rk.flash_expands_kv(q, k, v) is not grouped
    block = rk.block_attention(q, k, v, True)
    dout = torch.randn_like(q)
    got = rk.block_backward(dout, q, k, v, block.out, block.lse, True, block.extra)
    assert fake.kv_heads == ([2, 2] if grouped else [4, 4])
    want = rk.math_block_backward(dout, q, k, v, block.out, block.lse, True)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
