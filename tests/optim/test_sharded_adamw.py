"""ShardedAdamW on flat shards against torch.optim.AdamW on the same parameters."""

import pytest
import torch

from megatronish.optim.sharded_adamw import ShardedAdamW, decay_runs


def test_decay_runs_cover_the_shard_in_order():
    assert decay_runs(10, [(2, 4), (6, 10)]) == [
        (0, 2, False),
        (2, 4, True),
        (4, 6, False),
        (6, 10, True),
    ]
    assert decay_runs(5, []) == [(0, 5, False)]
    assert decay_runs(5, [(0, 5)]) == [(0, 5, True)]


@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_matches_torch_adamw_with_decay_groups(grad_scale):
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (5,), (4, 6), (6,), (3,)]  # matrices decay, vectors do not
    params = [torch.randn(s, generator=gen) for s in shapes]
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    flat = torch.cat([p.reshape(-1) for p in params])
    decay = [(offsets[i], offsets[i + 1]) for i, p in enumerate(params) if p.dim() == 2]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [
        {"params": [p for p in ref if p.dim() == 2], "weight_decay": 0.1},
        {"params": [p for p in ref if p.dim() < 2], "weight_decay": 0.0},
    ]
    torch_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt = ShardedAdamW([flat.numel()], "cpu", betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g * grad_scale
        torch_opt.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        opt.step([(flat, flat_grad, decay)], lr=1e-2, grad_scale=grad_scale)
        torch.testing.assert_close(flat_grad, torch.cat([p.grad.reshape(-1) for p in ref]))
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1) for p in ref]))
    assert opt.step_count == 5
