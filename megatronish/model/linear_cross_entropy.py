"""The output projection and the mean cross entropy in one pass over token chunks.

With the whole vocabulary on one rank (tp = 1) the head never materialises the ``[tokens, V]``
logits: for each chunk of tokens it computes the chunk's logits, their log-softmax, the loss and,
when grads are wanted, the chunk's gradient ``softmax - one_hot`` and from it the grads of the
hidden states and of the weight. Backward only scales those by the incoming grad. What stays
alive from forward to backward is ``[tokens, h]`` plus the weight's ``[V, h]`` instead of
``[tokens, V]``, and the chunk buffers are small and reused, where full-vocabulary buffers are
fresh pages on a CPU and often the step's memory peak on a GPU. The same matmuls run as in the
unfused head (the two grad matmuls move from backward into forward).

The matmuls run in the input's dtype (or the autocast dtype) and the softmax and the loss in
fp32, as autocast would run the unfused head; the weight's grad is summed over chunks in fp32.
"""

from __future__ import annotations

import torch

# A chunk's logits are at least this many bytes (fewer, larger matmuls) ...
MIN_CHUNK_BYTES = 8 << 20


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's logits about the size of the hidden states (as few chunks as
    the memory saving allows), and not under ``MIN_CHUNK_BYTES`` of fp32 logits."""
    by_hidden = -(-tokens * hidden // vocab)
    by_bytes = MIN_CHUNK_BYTES // (4 * vocab)
    return max(1, min(tokens, max(by_hidden, by_bytes)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, vocab_size):
        n, dtype = x.shape[0], _compute_dtype(x)
        step = chunk_tokens(n, x.shape[1], vocab_size)
        with torch.autocast(x.device.type, enabled=False):
            w = weight[:vocab_size].to(dtype)  # padding rows get no logits and no grad
            grad_x = torch.empty_like(x)
            grad_w = torch.zeros_like(weight, dtype=torch.float32)  # summed over chunks in fp32
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for start in range(0, n, step):
                xc = x[start : start + step].to(dtype)
                idx = target[start : start + step].unsqueeze(-1)
                log_probs = torch.log_softmax((xc @ w.t()).float(), dim=-1)
                total -= log_probs.gather(-1, idx).sum()
                grad = log_probs.exp_()  # d(sum of chunk losses)/d(logits) = softmax - one_hot
                grad.scatter_add_(-1, idx, grad.new_full(idx.shape, -1.0))
                grad = grad.to(dtype)
                same = dtype == weight.dtype == x.dtype
                if same:  # straight into the output
                    torch.mm(grad, w, out=grad_x[start : start + step])
                else:
                    grad_x[start : start + step] = grad @ w
                if same and dtype == torch.float32:
                    grad_w[:vocab_size].addmm_(grad.t(), xc)
                else:
                    grad_w[:vocab_size] += grad.t() @ xc
        ctx.save_for_backward(grad_x, grad_w)
        ctx.tokens = n
        return total / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.tokens
        return grad_x.mul_(scale.to(grad_x.dtype)), grad_w.mul_(scale), None, None


def _loss_only(x, weight, target, vocab_size) -> torch.Tensor:
    n, dtype = x.shape[0], _compute_dtype(x)
    step = chunk_tokens(n, x.shape[1], vocab_size)
    w = weight[:vocab_size].to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.autocast(x.device.type, enabled=False):
        for start in range(0, n, step):
            logits = (x[start : start + step].to(dtype) @ w.t()).float()
            idx = target[start : start + step].unsqueeze(-1)
            total -= torch.log_softmax(logits, dim=-1).gather(-1, idx).sum()
    return total / n


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Mean cross entropy of ``x @ weight[:vocab_size].T`` against ``target``.

    ``x`` is ``[tokens, h]``, ``weight`` ``[V_padded, h]``, ``target`` ``[tokens]`` ids below
    ``vocab_size``; rows of ``weight`` from ``vocab_size`` on (padding) are left out.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, target, vocab_size)
    return _loss_only(x, weight, target, vocab_size)
