"""The output projection and the mean cross entropy in one pass over token chunks.

With the whole vocabulary on one rank (tp = 1) the head never materialises the ``[tokens, V]``
logits: for each chunk of tokens it computes the chunk's logits, their log-softmax, the loss and,
when grads are wanted, the chunk's gradient ``softmax - one_hot`` and from it the grads of the
hidden states and of the weight. Backward only scales those by the incoming grad. What stays
alive from forward to backward is ``[tokens, h]`` plus the weight's ``[V, h]`` (fp32) instead of
``[tokens, V]``, and the chunk buffers are small and reused, where full-vocabulary buffers are
fresh pages on a CPU and often the step's memory peak on a GPU. The same matmuls run as in the
unfused head (the two grad matmuls move from backward into forward).

They use the whole padded vocabulary (a multiple of 128 rows: aligned GEMMs on GPUs) and mask
the padding logits to -inf before the softmax, as the vocab-parallel loss does, so padding rows
get exactly zero grad. A target id in ``[vocab_size, padded)`` therefore has log-probability
-inf: the loss is inf and the trainer skips the step (``trainer.max_skipped_steps``), where the
unpadded head raised an index error. Data is checked against the tokenizer when it is built
(:func:`megatronish.data.build.check_token_ids`; files over 256M tokens only in their first and
last 16M tokens); an id at or above the padded width still fails in the gather.

Precision. In fp32 everything is fp32. In 16 bits (bf16 params, or autocast) the roundings to
16 bits are, as autocast would run the unfused head:

- the logits: one (the output of the 16-bit GEMM); log-softmax and loss in fp32;
- the logits' grad ``softmax - one_hot``: computed in fp32, rounded once to 16 bits as the input
  of both grad GEMMs;
- the weight's grad: none. Its GEMM multiplies the 16-bit operands with an fp32 output (their
  products are exact in fp32, the sums fp32): cuBLAS's fp32-output GEMM on CUDA
  (``torch.mm(..., out_dtype=torch.float32)``, torch >= 2.8), the operands upcast to fp32
  elsewhere. Chunks are summed and the grad scaled in fp32. A weight whose fp32 main grad the
  data-parallel layer keeps (:mod:`megatronish.data_parallel.zero`) gets it added there directly
  (Megatron's gradient-accumulation fusion), and receives only a placeholder grad, so the
  layer's per-parameter hook fires and counts it; any other weight gets the fp32 grad from
  autograd, which casts it to the weight's dtype (one rounding for a 16-bit weight);
- the hidden states' grad: two. The 16-bit GEMM's output is rounded in forward; backward scales
  it by the incoming grad over the token count in fp32 (a scale of 1/3 rounded to bf16 first
  would be off by up to 0.2%) and rounds once more.

Split backward (zero-bubble schedules, :mod:`megatronish.tensor_parallel.weight_grad`): the
weight's grad is computed in forward already, so its W job only scales it and hands it over,
through the main-grad addition and placeholder above when the weight has one. While the store is
deferring, backward (B) scales the hidden states' grad only; the weight's fp32 grad waits for W.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.tensor_parallel.weight_grad import GradPairs, WeightGradStore, weight_grads

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

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


# cuBLAS's GEMM of 16-bit operands with an fp32 output (``aten::mm.dtype``, CUDA only: torch
# >= 2.8); the schema is there on CPU builds of those torch versions too.
HAS_FP32_OUTPUT_MM = "dtype" in torch.ops.aten.mm.overloads()


def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit matrices as an fp32 matrix, never rounded to 16 bits: products of
    16-bit values are exact in fp32, so only the fp32 sums round. On CUDA cuBLAS's fp32-output
    GEMM where torch has it, elsewhere the operands upcast to fp32."""
    if a.is_cuda and HAS_FP32_OUTPUT_MM:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _add_weight_grad(grad_w: torch.Tensor | None, grad: torch.Tensor, xc: torch.Tensor):
    """``grad_w + grad.T @ xc`` in fp32 (``grad_w`` None: this is the first chunk's)."""
    if grad.dtype == torch.float32:
        return grad.t() @ xc if grad_w is None else grad_w.addmm_(grad.t(), xc)
    product = fp32_product(grad.t(), xc)
    return product if grad_w is None else grad_w.add_(product)


def _log_probs(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 log-softmax over the first ``vocab_size`` columns; padding columns get -inf."""
    logits = logits.float()  # a fresh product (or its fp32 copy): masked in place
    if logits.shape[-1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab_size: int,
        weight_shared: bool,
        store: WeightGradStore | None,
        token_weights: torch.Tensor | None,
        divisor: float | None,
    ) -> torch.Tensor:
        n, dtype = x.shape[0], _compute_dtype(x)
        step = chunk_tokens(n, x.shape[1], weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dtype)
            grad_x = torch.empty_like(x)
            grad_w = None  # fp32, summed over chunks
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            same = dtype == weight.dtype == x.dtype
            for start in range(0, n, step):
                xc = x[start : start + step].to(dtype)
                idx = target[start : start + step].unsqueeze(-1)
                log_probs = _log_probs(xc @ w.t(), vocab_size)
                wc = None if token_weights is None else token_weights[start : start + step, None]
                total -= _picked_sum(log_probs, idx, wc)
                grad = log_probs.exp_()  # d(sum of chunk losses)/d(logits) = softmax - one_hot
                grad.scatter_add_(-1, idx, grad.new_full(idx.shape, -1.0))
                if wc is not None:
                    grad.mul_(wc)
                grad = grad.to(dtype)
                if same:  # straight into the output
                    torch.mm(grad, w, out=grad_x[start : start + step])
                else:
                    grad_x[start : start + step] = grad @ w
                grad_w = _add_weight_grad(grad_w, grad, xc)
            if grad_w is None:  # no tokens
                grad_w = torch.zeros_like(weight, dtype=torch.float32)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.tokens = n if divisor is None else divisor
        ctx.weight, ctx.weight_shared, ctx.store = weight, weight_shared, store
        return total / ctx.tokens

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x, grad_w = ctx.saved_tensors
        weight, shared = ctx.weight, ctx.weight_shared
        scale = grad_loss.float() / ctx.tokens  # e.g. 1/3 for 3 microbatches: not in bf16
        if grad_x.dtype == torch.float32:
            grad_x.mul_(scale)
        else:  # the 16-bit product scaled in fp32, then rounded (its second rounding)
            grad_x.copy_(grad_x.float().mul_(scale))
        none = (None,) * 6  # target, vocab_size, weight_shared, store, token_weights, divisor
        if not ctx.needs_input_grad[1]:
            return grad_x, None, *none

        def job() -> GradPairs:
            return [(weight, _weight_grad(weight, grad_w.mul_(scale), shared))]

        grads = weight_grads(ctx.store, job)
        return grad_x, None if grads is None else grads[id(weight)], *none


def _weight_grad(weight: torch.Tensor, grad_w: torch.Tensor, weight_shared: bool) -> torch.Tensor:
    """What autograd gets for the weight: its fp32 grad, or, when that went straight into the
    weight's fp32 main grad, a placeholder in the weight's dtype."""
    add_to_main_grad = getattr(weight, "accumulate_main_grad", None)
    if add_to_main_grad is None or weight.dtype == grad_w.dtype:
        return grad_w  # autograd accumulates it (in the weight's dtype)
    # A weight also used by the embedding lookup gets that grad added to ours by autograd: the
    # placeholder is zero then, and the hook adds the sum. Otherwise the hook drops it.
    add_to_main_grad(grad_w, grad_is_placeholder=not weight_shared)
    make = torch.zeros if weight_shared else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def _picked_sum(
    log_probs: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """The (weighted) sum of the targets' log-probabilities ``[tokens, 1]`` of a chunk."""
    picked = log_probs.gather(-1, idx)
    return picked.sum() if weights is None else (picked * weights).sum()


def _loss_only(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    token_weights: torch.Tensor | None,
    divisor: float | None,
) -> torch.Tensor:
    n, dtype = x.shape[0], _compute_dtype(x)
    step = chunk_tokens(n, x.shape[1], weight.shape[0])
    w = weight.to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.autocast(x.device.type, enabled=False):
        for start in range(0, n, step):
            log_probs = _log_probs(x[start : start + step].to(dtype) @ w.t(), vocab_size)
            idx = target[start : start + step].unsqueeze(-1)
            wc = None if token_weights is None else token_weights[start : start + step, None]
            total -= _picked_sum(log_probs, idx, wc)
    return total / (n if divisor is None else divisor)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    weight_shared: bool = False,
    store: WeightGradStore | None = None,
    token_weights: torch.Tensor | None = None,
    divisor: float | None = None,
) -> torch.Tensor:
    """Mean cross entropy of the logits ``x @ weight.T`` over ids below ``vocab_size``.

    ``x`` is ``[tokens, h]``, ``weight`` ``[V_padded, h]``, ``target`` ``[tokens]`` ids below
    ``vocab_size``; logits of the padding rows (``vocab_size`` on) are left out of the softmax
    and their rows get zero grad. A target id in ``[vocab_size, V_padded)`` is not checked here
    (that would make the host wait for the device): its log-probability is -inf, so the loss is
    inf (the module docstring says where ids are checked). ``weight_shared``: the weight also
    feeds other ops of the same backward (the tied embedding on the same chunk). ``store``:
    where the weight's grad goes (:mod:`megatronish.tensor_parallel.weight_grad`).
    ``token_weights`` (``[tokens]`` fp32) weighs each token's loss (0 leaves it out) and
    ``divisor`` replaces the token count: the result is ``sum(w_i loss_i) / divisor``.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(
            x, weight, target, vocab_size, weight_shared, store, token_weights, divisor
        )
    return _loss_only(x, weight, target, vocab_size, token_weights, divisor)
