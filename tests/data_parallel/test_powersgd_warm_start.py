"""PowerSGD's warm start: each step's power iteration starts from the ``Q`` the last step found,
not from the seeded first one (Vogels et al. 2019, section 3: one iteration per step suffices only
because the iterations continue across steps)."""

import torch

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.powersgd import PowerSGD
from megatronish.distributed.comm import single_group

N, M, RANK = 40, 24, 2


def _bucket() -> Bucket:
    """An ``N x M`` matrix (compressed) and a vector (all-reduced as it is), sharded over 2 ranks
    (so the bucket is compressed) and reduced here over a group of one: the arithmetic alone."""
    params = [
        ("w", torch.nn.Parameter(torch.empty(N, M))),
        ("b", torch.nn.Parameter(torch.empty(M))),
    ]
    numel = N * M + M
    return Bucket(params, [0, N * M], numel, 2, 0, False, torch.device("cpu"))


def _orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """The Gram-Schmidt basis of ``p``'s columns, from a QR decomposition (signs as Gram-Schmidt
    leaves them: R's diagonal positive)."""
    q, r = torch.linalg.qr(p.double())
    return (q * torch.sign(torch.diagonal(r))).float()


def test_each_step_starts_its_power_iteration_from_the_last_steps_q():
    """Three steps of fresh grads against PowerSGD written out by hand: ``P = M Q``, ``Q`` being
    the previous step's ``M^T P`` (the seeded one at the first step), and the state holds that
    ``Q`` after each step. Without the warm start every step would start from the seeded ``Q``:
    the first step agrees, the second does not."""
    bucket = _bucket()
    codec = PowerSGD([bucket], RANK, seed=0)
    state = codec.states[0]
    q = state.qs[0].clone()  # the seeded start, the same on every dp rank
    error = torch.zeros(N, M)
    group = single_group("dp")
    generator = torch.Generator().manual_seed(5)
    for step in range(3):
        grads = torch.randn(bucket.numel, generator=generator)
        full = grads.clone()
        reduction = codec.launch(bucket, full, full, False, group)
        reduction.advance()
        reduction.finish()

        m = grads[: N * M].view(N, M) + error
        p = _orthonormal_columns(m @ q)
        q = m.t() @ p  # the next step's start
        sent = p @ q.t()
        error = m - sent
        torch.testing.assert_close(state.qs[0], q, rtol=1e-4, atol=1e-5, msg=f"step {step}: Q")
        got = full[: N * M].view(N, M)
        torch.testing.assert_close(got, sent, rtol=1e-4, atol=1e-5, msg=f"step {step}: P Q^T")
        assert torch.equal(full[N * M :], grads[N * M :])  # the vector: reduced as it is
