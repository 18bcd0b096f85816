"""The chunked output projection + cross entropy against F.linear + F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.model import linear_cross_entropy as lce


def _inputs(tokens=37, hidden=8, padded=24, vocab=20, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(padded, hidden, generator=gen).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    return x, w, target


def _reference(x, w, target, vocab):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = F.cross_entropy(F.linear(x, w)[:, :vocab].float(), target)
    (loss * 3.0).backward()
    return loss, x.grad, w.grad


def test_chunk_size_follows_the_hidden_size_with_a_floor():
    assert lce.chunk_tokens(2048, 128, 4096) == 512  # 8 MiB of fp32 logits
    assert lce.chunk_tokens(8192, 4096, 131072) == 256  # logits chunk = hidden states' size
    assert lce.chunk_tokens(10, 4096, 131072) == 10
    assert lce.chunk_tokens(1, 1, 10**9) == 1


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4])  # one chunk; chunks by the hidden size
@pytest.mark.parametrize("vocab", [20, 24])  # padded and unpadded
def test_loss_and_grads_match_linear_plus_cross_entropy(monkeypatch, chunk_bytes, vocab):
    monkeypatch.setattr(lce, "MIN_CHUNK_BYTES", chunk_bytes)
    x, w, target = _inputs(vocab=vocab)
    step = lce.chunk_tokens(37, 8, vocab)
    assert step == 37 if chunk_bytes > 1 << 20 else 37 % step and step < 37  # a short last chunk
    ref_loss, ref_gx, ref_gw = _reference(x, w, target, vocab)
    loss = lce.linear_cross_entropy(x, w, target, vocab)
    (loss * 3.0).backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(x.grad, ref_gx)
    torch.testing.assert_close(w.grad, ref_gw)
    assert not w.grad[vocab:].any()  # padding rows: no logits, no grad
    with torch.no_grad():  # evaluation computes the loss without any grads
        torch.testing.assert_close(lce.linear_cross_entropy(x, w, target, vocab), ref_loss)


def test_bf16_autocast_runs_the_matmuls_in_bf16():
    x, w, target = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = F.cross_entropy(F.linear(x, w)[:, :20].float(), target)
        loss = lce.linear_cross_entropy(x, w, target, 20)
    torch.testing.assert_close(loss, ref_loss)  # same bf16 logits, fp32 softmax
    loss.backward()
    _, ref_gx, ref_gw = _reference(x, w, target, 20)
    assert x.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, ref_gx / 3.0, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(w.grad, ref_gw / 3.0, rtol=0.05, atol=2e-3)


def test_a_second_backward_through_the_same_graph_is_refused():
    x, w, target = _inputs()
    loss = lce.linear_cross_entropy(x, w, target, 20)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


class Matmuls(TorchDispatchMode):
    """Records the ``(m, k, n)`` of every matmul."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in ("aten::mm", "aten::addmm"):
            a, b = args[-2:]
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [True, False])
def test_logits_use_the_padded_width_and_padding_never_reaches_the_softmax(grad):
    """The GEMMs run over all 24 (padded) rows; padding rows of a huge value, which would
    dominate the softmax if they leaked, change neither the loss nor any grad."""
    x, w, target = _inputs(vocab=20)
    with torch.no_grad():
        w[20:] = 50.0
    ref_loss, ref_gx, ref_gw = _reference(x, w, target, 20)
    with Matmuls() as seen, torch.set_grad_enabled(grad):
        loss = lce.linear_cross_entropy(x, w, target, 20)
    assert seen.shapes and all(24 in shape for shape in seen.shapes), seen.shapes
    torch.testing.assert_close(loss, ref_loss)
    if grad:
        (loss * 3.0).backward()
        torch.testing.assert_close(x.grad, ref_gx)
        torch.testing.assert_close(w.grad[:20], ref_gw[:20])
        assert torch.equal(w.grad[20:], torch.zeros_like(w.grad[20:]))  # exactly zero


def test_bf16_input_grad_is_scaled_in_fp32_and_rounded_once_more():
    """A microbatch of 3 scales its loss by 1/3, not a power of two: the head input's bf16 grad
    is its unscaled grad (the bf16 GEMM's output: one rounding) times 1/3 / tokens in fp32,
    rounded once more: two roundings in all (rounding the scale to bf16 first, a third, is off
    by up to 0.2%, more than a bf16 rounding for many elements)."""
    x, w, target = _inputs(tokens=32, dtype=torch.bfloat16)
    w = w.detach().bfloat16().requires_grad_()
    (lce.linear_cross_entropy(x, w, target, 20) * (1.0 / 3)).backward()
    unscaled = x.detach().clone().requires_grad_()
    (lce.linear_cross_entropy(unscaled, w, target, 20) * 32.0).backward()  # grad_loss / tokens = 1
    exact = unscaled.grad.float() * (torch.tensor(1.0 / 3) / 32)  # the fp32-scaled grad
    _, exponent = torch.frexp(exact)  # |exact| in [2^(e-1), 2^e): a bf16 ulp there is 2^(e-8)
    half_ulp = torch.ldexp(torch.ones_like(exact), exponent - 9)
    assert ((x.grad.float() - exact).abs() <= half_ulp).all()  # one round-to-nearest, no more


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4])  # one chunk; 3 chunks of 13, 13, 11 tokens
def test_bf16_weight_grad_is_an_fp32_output_product_never_rounded_to_bf16(monkeypatch, chunk_bytes):
    """bf16 compute (bf16 input, an fp32 weight: autograd hands back the head's own fp32 weight
    grad). A zero weight makes every logit 0, so the logits' grad the head rounds to bf16 is
    known exactly: bf16(1/20 - one_hot) (1/20 and 19/20 are far from a bf16 rounding tie, so an
    fp32 softmax rounds to the same), 0 in the padding columns. The weight's grad must be the
    product of those bf16 values and the bf16 input with an fp32 output: exact products, fp32
    sums, so within 37 roundings of 2^-24 of the sum of |terms| of the fp64 product. A product
    rounded to bf16 (per chunk) is off by up to 2^-9 of the chunk's sum."""
    monkeypatch.setattr(lce, "MIN_CHUNK_BYTES", chunk_bytes)
    x, _, target = _inputs(tokens=37, dtype=torch.bfloat16)
    w = torch.zeros(24, 8, requires_grad=True)
    (lce.linear_cross_entropy(x, w, target, 20) * 37.0).backward()  # grad_loss / tokens = 1
    g = torch.zeros(37, 24, dtype=torch.float64)
    g[:, :20] = 1 / 20
    g[torch.arange(37), target] -= 1
    g = g.bfloat16().double()  # the head's bf16 logits grad
    want, size = g.t() @ x.double(), g.abs().t() @ x.double().abs()
    assert w.grad.dtype == torch.float32
    err = (w.grad.double() - want).abs()
    assert (err <= 37 * 2**-24 * size).all(), (err / size.clamp_min(1e-30)).max()
    assert torch.equal(w.grad[20:], torch.zeros_like(w.grad[20:]))
