"""The one-process megatronish run against independent implementations of the same GPT.

Every layout is compared with megatronish's own one-process run elsewhere; a bug all layouts
share (a loss scale, an optimizer detail, the schedule) would pass those. Here the reference is
separate code: for llama, its own modules (``megatronish.testing.reference_gpt``: nn.RMSNorm,
SDPA), for gpt2 transformers' ``GPT2LMHeadModel``; a plain cross entropy,
``torch.optim.AdamW``, ``clip_grad_norm_`` and a schedule written out below, fed the same
weights and token batches. Per step we compare the gradients before clipping (tensor by
tensor), the pre-clip global norm, the loss and the updated weights.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from megatronish.checkpoint.gather import gather_tp_params
from megatronish.hf.to_hf import to_hf
from megatronish.testing.compare import param_gaps
from megatronish.testing.reference_gpt import (
    RefConfig,
    ReferenceGPT,
    build_adamw,
    load_megatronish_weights,
    reference_state,
)
from megatronish.testing.runs import build_trainer

STEPS = 5
# fp32 round-off between two implementations. Measured: loss <= 2e-7; norm <= 2e-7 at step 1
# and <= 1e-5 later; grads <= 4e-7 per tensor at step 1 and <= 3.2e-5 model-wide later on an
# Intel Xeon, 1.1e-4 on an AMD EPYC with the baseline kernels of `make test-kernels` (Adam turns
# round-off of near-zero grads, e.g. gpt2's key bias, into lr-sized differences); weights
# <= 1e-5. A wrong loss scale, decay group, clip or schedule is >= 1e-2. Later-step norm
# tolerance as in the layout parity tests.
LOSS_RTOL, GRAD_RTOL, PARAM_RTOL = 1e-5, 1e-3, 1e-4
FIRST_NORM_RTOL, NORM_RTOL = 1e-6, 1e-4
FIRST_STEP_GRAD_RTOL = 1e-5  # every tensor, before any update


def reference_lr(step: int, o, s, max_steps: int) -> float:
    """Linear warm-up to ``lr``, then cosine down to ``min_lr`` (Megatron's schedule)."""
    if step < s.warmup_steps:
        return o.lr * (step + 1) / s.warmup_steps
    decay = s.decay_steps or max_steps
    frac = min((step - s.warmup_steps) / max(decay - s.warmup_steps, 1), 1.0)
    return s.min_lr + 0.5 * (o.lr - s.min_lr) * (1 + math.cos(math.pi * frac))


def capture_grads(trainer) -> dict:
    """Record megatronish's reduced grads (before clipping) when its optimizer is called."""
    seen: dict = {}
    step = trainer.optimizer.step

    def recording_step(shards, lr, **kw):
        seen["grads"] = {
            name: g.clone() for b in trainer.zero.buckets for name, _, g in b.views(b.grad_flat)
        }
        seen["lr"] = lr
        return step(shards, lr, **kw)

    trainer.optimizer.step = recording_step
    return seen


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def llama_reference(trainer):
    """``(model, ids -> logits, megatronish tensors -> the model's names)``: the plain llama."""
    ref = ReferenceGPT(RefConfig.from_spec(trainer.spec, fused=False))
    load_megatronish_weights(ref, gather_tp_params(trainer.chunks, trainer.topo))
    return ref, ref, lambda tensors: reference_state(tensors, ref)


def gpt2_reference(trainer):
    """The same for gpt2, with transformers' GPT2LMHeadModel (learned positions, LayerNorm with
    biases, tanh GELU, tied head), loaded through the HF export mapping."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model_cfg = OmegaConf.to_container(trainer.cfg.model, resolve=True)

    def names(tensors):
        return to_hf(tensors, model_cfg, vocab_size=trainer.spec.vocab_size)[1]

    config, state = to_hf(
        gather_tp_params(trainer.chunks, trainer.topo),
        model_cfg,
        vocab_size=trainer.spec.vocab_size,
    )
    ref = GPT2LMHeadModel(GPT2Config(**config, attn_implementation="eager"))
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    return ref, lambda ids: ref(ids).logits, names


def side_by_side(overrides: list[str]):
    """Train both for STEPS steps; yields per-step ``(ours, reference)`` measurements."""
    trainer = build_trainer(0, 1, ["parallel.zero_stage=0", *overrides], STEPS)
    cfg, data = trainer.cfg, trainer.train_data
    o, s, t = cfg.optimizer, cfg.scheduler, cfg.trainer
    build = gpt2_reference if trainer.spec.arch == "gpt2" else llama_reference
    ref, forward, reference_state = build(trainer)
    # decay on matrices, none on norms and biases; torch's default (foreach) implementation
    opt = build_adamw(ref, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps, fused=None)
    seen = capture_grads(trainer)
    n_micro = t.global_batch_size // t.micro_batch_size
    vocab = trainer.spec.vocab_size
    for step in range(STEPS):
        ours = trainer.train_step()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for m in range(n_micro):
            first = step * t.global_batch_size + m * t.micro_batch_size
            batch = torch.stack([data[i] for i in range(first, first + t.micro_batch_size)])
            logits = forward(batch[:, :-1])[..., :vocab]  # the padding rows are not tokens
            micro = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            (micro / n_micro).backward()
            loss += micro.item() / n_micro
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        max_norm = o.grad_clip if o.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        lr = reference_lr(step, o, s, t.max_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        our_grads = reference_state(seen["grads"])
        worst_grad = max(relative(our_grads[n], g) for n, g in ref_grads.items())
        weights = reference_state(gather_tp_params(trainer.chunks, trainer.topo))
        ref_weights = {n: p.detach() for n, p in ref.named_parameters()}
        yield {
            "loss": (ours.loss, loss),
            "norm": (ours.grad_norm, norm),
            "lr": (seen["lr"], lr),
            "clipped": norm > max_norm,
            "grad_gap": param_gaps(ref_grads, our_grads)[0],  # model-wide
            "worst_grad_gap": worst_grad,  # the worst tensor
            "param_gap": param_gaps(ref_weights, weights)[0],
        }


CASES = {
    # 4 microbatches of 2 accumulate into each step; the norm exceeds 1.0, so every step clips
    "accumulate-clip": [],
    # no clipping, a larger rate and stronger decay: the raw grads drive Adam unscaled
    "accumulate-noclip": ["optimizer.grad_clip=0", "optimizer.weight_decay=0.3"],
    # a limit above every norm: clipping must leave the grads alone
    "clip-inactive": ["optimizer.grad_clip=10"],
    # one microbatch per step, warm-up then the cosine decay inside the run
    # gpt2 against transformers' implementation, accumulating and clipping
    "gpt2-accumulate-clip": ["model.arch=gpt2", "model.num_query_groups=8"],
    "one-micro-cosine": [
        "trainer.global_batch_size=2",
        "scheduler.warmup_steps=1",
        "scheduler.decay_steps=4",
        "scheduler.min_lr=1e-4",
    ],
}


@pytest.mark.parametrize("case", CASES)
def test_one_process_run_matches_an_independent_plain_pytorch_gpt(case):
    steps = list(side_by_side(CASES[case]))
    assert len(steps) == STEPS
    if case.endswith("accumulate-clip"):
        assert all(m["clipped"] for m in steps)  # the clip path really ran
    if case == "clip-inactive":
        assert not any(m["clipped"] for m in steps)
    if case == "accumulate-noclip":
        assert all(m["norm"][1] > 1.0 for m in steps)  # clipping at 1.0 would have changed it
    for i, m in enumerate(steps):
        norm_rtol = FIRST_NORM_RTOL if i == 0 else NORM_RTOL
        for key, rtol in (("loss", LOSS_RTOL), ("norm", norm_rtol), ("lr", 1e-12)):
            ours, ref = m[key]
            assert abs(ours - ref) <= rtol * abs(ref), f"step {i + 1} {key}: {ours} vs {ref}"
        if i == 0:
            assert m["worst_grad_gap"] < FIRST_STEP_GRAD_RTOL, (
                f"grads differ by {m['worst_grad_gap']:.2e}"
            )
        assert m["grad_gap"] < GRAD_RTOL, f"step {i + 1} grads differ by {m['grad_gap']:.2e}"
        assert m["param_gap"] < PARAM_RTOL, f"step {i + 1} weights differ by {m['param_gap']:.2e}"
