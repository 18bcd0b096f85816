"""The chunked output projection + cross entropy against F.linear + F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

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
