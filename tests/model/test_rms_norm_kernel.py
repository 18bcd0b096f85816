"""Which RMSNorm runs where (torch's fused CUDA kernel or the fp32-statistics function), and
that both compute in fp32 with one rounding where a CPU can run both."""

import pytest
import torch
import torch.nn.functional as F

from megatronish.model import rms_norm as rms
from megatronish.model.blocks import Norm
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.testing.runs import test_config as tiny_config

VERSIONS = [(2, 6), (2, 7), (2, 8), (2, 9), (2, 11), (2, 13), (3, 0)]


def test_torchs_kernel_for_fp32_and_for_16_bit_on_cuda_from_2_9_only():
    for device, dtype, version in (
        (d, t, v)
        for d in ("cpu", "cuda")
        for t in (torch.float32, torch.bfloat16, torch.float16)
        for v in VERSIONS
    ):
        fused = device == "cuda" and version >= (2, 9)  # aten::_fused_rms_norm on CUDA
        want = "torch" if dtype == torch.float32 or fused else "fp32_statistics"
        assert rms.rms_norm_kernel(device, dtype, version) == want, (device, dtype, version)


@pytest.mark.parametrize("as_cuda_2_9", [False, True])
def test_the_model_norm_runs_the_kernel_the_rule_picks(monkeypatch, as_cuda_2_9):
    rule = rms.rms_norm_kernel
    if as_cuda_2_9:
        monkeypatch.setattr(rms, "rms_norm_kernel", lambda d, t, v: rule("cuda", t, (2, 9)))
    spec = ModelSpec.from_config(tiny_config([], 1).model, 250)
    norm = Norm(spec, TPContext()).bfloat16()
    torch.nn.init.ones_(norm.weight)
    y = norm(torch.randn(4, 2, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True))
    ours = type(y.grad_fn).__name__.startswith("_LowPrecisionRMSNorm")
    assert ours != as_cuda_2_9


@pytest.mark.skipif(
    rms.TORCH_VERSION < (2, 7),
    reason="torch 2.6's bf16 F.rms_norm rounds the normalised value before the weight (twice)",
)
def test_torchs_bf16_rms_norm_on_this_cpu_rounds_once_like_ours():
    """Both against the fp32 norm of the same bf16 values: within one bf16 rounding (2^-8
    relative, with margin), forward and backward."""
    torch.manual_seed(0)
    x = (3 * torch.randn(64, 4, 256)).bfloat16()
    w = (1 + 0.1 * torch.randn(256)).bfloat16()
    g = torch.randn(64, 4, 256).bfloat16()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    F.rms_norm(xr, (256,), wr, eps=1e-5).backward(g.float())
    ref_y = F.rms_norm(xr.detach(), (256,), wr.detach(), eps=1e-5)
    for norm in (lambda a, b: F.rms_norm(a, (256,), b, eps=1e-5), rms.low_precision_rms_norm):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = norm(xb, wb, 1e-5) if norm is rms.low_precision_rms_norm else norm(xb, wb)
        y.backward(g)
        assert y.dtype == xb.grad.dtype == torch.bfloat16
        for got, ref in ((y, ref_y), (xb.grad, xr.grad)):
            err = (got.float() - ref).abs()
            assert (err <= 2**-8 * ref.abs() + 1e-6).all()
        torch.testing.assert_close(wb.grad.float(), wr.grad, rtol=2**-7, atol=1e-3)
