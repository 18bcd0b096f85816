"""bf16 training as Megatron-LM runs it: bf16 params and activations, fp32 main params and grads.

Every layout in bf16 tracks the one-process bf16 run (bf16 tolerance: a relative loss gap under
5e-3 and a model-wide parameter gap under 1e-2 after 6 steps; measured up to 9e-5 and 4e-3), moves exactly half the activation
bytes of fp32 over tp and pp, and resumes bit-exactly from checkpoints holding fp32 main params.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.checkpoint.format import resolve_step_dir
from megatronish.model import linear_cross_entropy as lce
from megatronish.model.rms_norm import low_precision_rms_norm
from megatronish.testing.compare import max_relative_loss_gap, param_gaps
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout
from megatronish.training.precision import apply_fp32_matmul_setting, fp32_matmul_setting

BF16 = ["trainer.precision=bf16"]
STEPS = 6
LOSS_RTOL, PARAM_RTOL = 5e-3, 1e-2
_REF = {}


def reference():
    if "ref" not in _REF:
        _REF["ref"] = [train_layout(0, 1, BF16, STEPS)]
    return _REF["ref"]


LAYOUTS = [
    (4, ["parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1"]),
    (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.zero_stage=3"]),
    (2, ["parallel.zero_stage=2", "parallel.grad_reduce_dtype=bf16"]),
    (8, ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "parallel.zero_stage=1"]),
]


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=[" ".join(x) for _, x in LAYOUTS])
def test_bf16_layouts_track_the_one_process_bf16_run(world, layout):
    got = run_world(train_layout, world, [*BF16, *layout], STEPS, timeout=300)
    ref = reference()
    assert max_relative_loss_gap(losses_of(ref), losses_of(got)) < LOSS_RTOL
    assert all(t.dtype == torch.bfloat16 for t in merge_params(got).values())
    model_gap, _ = param_gaps(_fp32(merge_params(ref)), _fp32(merge_params(got)))
    assert model_gap < PARAM_RTOL


def _fp32(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in params.items()}


def test_bf16_tracks_fp32_and_keeps_fp32_main_params_and_grads():
    low, ref = reference()[0], train_layout(0, 1, [], STEPS)
    # tracks fp32, and differs from it by far more than fp32 round-off (1e-7): it ran in bf16
    assert 1e-4 < max_relative_loss_gap(ref.losses, low.losses) < 2e-2
    trainer = build_trainer(0, 1, [*BF16, "parallel.zero_stage=0"], 1)
    trainer.train_step()
    zero = trainer.zero
    assert all(
        p.dtype == torch.bfloat16 and p.grad is None for c in zero.chunks for p in c.parameters()
    )
    for b in zero.buckets:
        assert b.main_shard.dtype == b.grad_flat.dtype == torch.float32
        assert b.param_flat.dtype == torch.bfloat16
        assert torch.equal(b.param_flat, b.main_shard.to(torch.bfloat16))  # cast after the step
        assert not torch.equal(b.main_shard, b.param_flat.float())  # not rounded to bf16


class ComputeDtypes(TorchDispatchMode):
    """Counts the matmuls and attention kernels that run, by the dtype of their inputs."""

    KERNELS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product")

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name.startswith(self.KERNELS):
            dtypes = {str(a.dtype) for a in args[:2] if isinstance(a, torch.Tensor)}
            self.seen[(name.replace("_for_cpu", ""), "+".join(sorted(dtypes)))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_every_matmul_and_attention_kernel_runs_in_the_configured_precision(precision, monkeypatch):
    """Forward and backward: every projection, the head and attention, none left in fp32 but
    the head's weight-grad GEMM (bf16 values with an fp32 output: fp32 operands on a CPU)."""
    trainer = build_trainer(0, 1, [f"trainer.precision={precision}"], 1)
    fp32_products = []
    product = lce.fp32_product
    monkeypatch.setattr(lce, "fp32_product", lambda *a: fp32_products.append(1) or product(*a))
    with ComputeDtypes() as seen:
        trainer.train_step()
    want = "torch.bfloat16" if precision == "bf16" else "torch.float32"
    if precision == "bf16":
        assert fp32_products and seen.seen.pop(("mm", "torch.float32")) == len(fp32_products)
    kernels = {name for name, _ in seen.seen}
    attention = "_scaled_dot_product_flash_attention"
    assert {"mm", attention, f"{attention}_backward"} <= kernels, seen.seen
    assert all(dtype == want for _, dtype in seen.seen), seen.seen


def _step_stats(rank, world, overrides):
    trainer = build_trainer(rank, world, overrides, 1)
    trainer.fit()
    return trainer.topo.stats.summary()


def test_bf16_moves_exactly_half_the_activation_bytes():
    layout = ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"]
    fp32 = run_world(_step_stats, 4, layout)
    bf16 = run_world(_step_stats, 4, [*BF16, *layout, "parallel.grad_reduce_dtype=bf16"])
    for full, half in zip(fp32, bf16):
        for key in ("tp/all_gather", "tp/reduce_scatter", "pp/send", "pp/recv"):
            assert half[key]["calls"] == full[key]["calls"], key
            assert 2 * half[key]["bytes"] == full[key]["bytes"], key
    dp = run_world(_step_stats, 2, [*BF16, "parallel.zero_stage=1"])
    dp_half = run_world(
        _step_stats, 2, [*BF16, "parallel.zero_stage=1", "parallel.grad_reduce_dtype=bf16"]
    )
    fp32_dp = run_world(_step_stats, 2, ["parallel.zero_stage=1"])
    for r in range(2):  # grads reduced in fp32 unless asked; params always gathered in bf16
        assert dp[r]["dp/reduce_scatter"] == fp32_dp[r]["dp/reduce_scatter"]
        assert 2 * dp_half[r]["dp/reduce_scatter"]["bytes"] == dp[r]["dp/reduce_scatter"]["bytes"]
        assert 2 * dp[r]["dp/all_gather"]["bytes"] == fp32_dp[r]["dp/all_gather"]["bytes"]


def test_bf16_resume_is_bit_exact_and_checkpoints_hold_fp32_main_params(tmp_path):
    layout = [*BF16, "parallel.zero_stage=1", "scheduler.decay_steps=6"]
    whole = run_world(train_layout, 2, layout, STEPS)
    run_world(train_layout, 2, layout, 3, None, str(tmp_path))
    resumed = run_world(train_layout, 2, layout, STEPS, str(tmp_path))
    assert losses_of(resumed) == losses_of(whole)[3:]
    a, b = merge_params(whole), merge_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = load_file(f"{resolve_step_dir(str(tmp_path))}/model-rank00000.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values())


def test_low_precision_rms_norm_matches_fp32_and_keeps_only_input_and_rsqrt():
    torch.manual_seed(0)
    x = torch.randn(16, 2, 64).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(64)).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = low_precision_rms_norm(x, w, 1e-5)
    assert sorted(str(t.dtype) for t in saved) == [
        "torch.bfloat16",
        "torch.bfloat16",
        "torch.float32",
    ]
    grad = torch.randn_like(y)
    y.backward(grad)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.rms_norm(xr, (64,), wr, eps=1e-5)
    ref.backward(grad.float())
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.float(), wr.grad, rtol=2e-2, atol=5e-2)


def test_tf32_is_set_for_cuda_only():
    assert fp32_matmul_setting("cuda", True) == "tf32"
    assert fp32_matmul_setting("cuda", False) == "ieee"
    assert fp32_matmul_setting("cpu", True) is None
    assert apply_fp32_matmul_setting(torch.device("cpu"), True) is None
