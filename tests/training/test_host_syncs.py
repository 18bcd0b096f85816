"""No hidden host-device synchronisations: the recorder itself on small snippets, and one training
step of every layout within its budget (a GPU runs ahead of Python only while the host never
waits for it; see megatronish/testing/host_syncs.py for what counts)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatronish.testing.host_syncs import HostSyncRecorder
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.training.numerics import TooManySkippedSteps
from megatronish.training.stop import StopRequest


class Once(torch.autograd.Function):
    """Runs ``read`` on the incoming gradient inside autograd's backward."""

    @staticmethod
    def forward(ctx, x, read):
        ctx.read = read
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.read(grad)
        return grad, None


# -- the recorder ---------------------------------------------------------------------------
D = torch.arange(6.0)  # made before recording: a device tensor
IDX = torch.tensor([0, 1, 1, 2])

SYNCS = {
    "item": lambda: D[0].item(),
    "__int__": lambda: int(D.sum()),
    "__float__": lambda: float(D[1]),
    "__bool__": lambda: 1 if D[1] > 0 else 0,
    "__index__": lambda: [1, 2, 3][IDX[0]],
    "__format__": lambda: f"{D.sum():.3f}",
    "tolist": lambda: D.tolist(),
    "cpu": lambda: D.cpu(),
    "numpy": lambda: D.numpy(),
    "aten::nonzero": lambda: D.nonzero(),
    "aten::bincount": lambda: torch.bincount(IDX, minlength=3),
    "aten::repeat_interleave": lambda: torch.repeat_interleave(D[:4], IDX),
    "aten::_unique2": lambda: torch.unique(IDX),
    "aten::index": lambda: D[D > 2],
    "aten::index_put_": lambda: D.clone().__setitem__(D > 2, 0.0),
    "aten::masked_select": lambda: D.masked_select(D > 2),
    "aten::equal": lambda: torch.equal(D, D),
    "torch.tensor(data, device=...)": lambda: torch.tensor([1, 2], device="cpu"),
    "torch.as_tensor(data, device=...)": lambda: torch.as_tensor([1, 2], device="cpu"),
    "Tensor.new_tensor(data, device=...)": lambda: D.new_tensor([1.0]),
    "host tensor .to(device)": lambda: torch.zeros(3).to(D.device),
    ".to(cpu)": lambda: D.to("cpu"),
    ".to(cpu) with copy": lambda: D.to("cpu", copy=True),
    "host tensor in aten::index": lambda: D[torch.tensor([0, 1])],
    "host tensor in aten::index_select": lambda: D.index_select(0, torch.arange(2)),
    "host tensor in aten::add": lambda: D + torch.ones(6),
}
KINDS = {".to(cpu) with copy": ".to(cpu)"}  # the kind recorded, where it differs from the key
COPIES = {
    "to the device": lambda: D.clone().copy_(torch.zeros(6)),
    "to the host": lambda: torch.zeros(6).copy_(D),
}


@pytest.mark.parametrize("kind", list(SYNCS))
def test_each_kind_of_sync_is_counted_once(kind):
    with HostSyncRecorder() as rec:
        SYNCS[kind]()
    assert [s.kind for s in rec.syncs] == [KINDS.get(kind, kind)], rec.report()
    assert "test_host_syncs.py" in rec.syncs[0].where


@pytest.mark.parametrize("direction", list(COPIES))
def test_a_blocking_copy_between_host_and_device_is_counted_once(direction):
    with HostSyncRecorder() as rec:
        COPIES[direction]()
    assert [s.kind for s in rec.syncs] == ["aten::copy_"], rec.report()


def test_device_work_and_host_data_count_nothing():
    with HostSyncRecorder() as rec:
        (D * 2 + 1).sum().sqrt()
        torch.repeat_interleave(D[:4], IDX, output_size=4)
        torch.zeros(3, device="cpu").fill_(2.0)
        host = torch.tensor([3.0, 1.0]) * 2  # no device argument: host data, free to read
        assert host.tolist() == [6.0, 2.0] and int(host.max().item()) == 6
        torch.zeros(3).to(D.device, non_blocking=True)  # pinned on a GPU: no wait
        host = torch.zeros(6)
        host.copy_(D, non_blocking=True).tolist()  # a host buffer stays one (read after an event)
        D.to(torch.float64).to(D.device)  # stays on the device
        D.to("cpu", non_blocking=True)  # into pinned memory on a GPU: no wait (read it later)
        torch.ones(6).to("cpu").tolist()  # host to host
        D + torch.tensor(2.0)  # a 0-dim host tensor: a scalar argument, no copy
        D[IDX.to(D.device, non_blocking=True)]  # the index moved first: no wait
        D.index_select(0, torch.arange(2, device=D.device))  # made on the device
        D.clone().copy_(torch.ones(6), non_blocking=True)  # the copy rule, not the mixing one
        torch.ones(6)[torch.arange(2)] + 1  # host only
    assert rec.syncs == [], rec.report()


def test_reads_inside_backward_are_counted():
    """Autograd runs hooks and custom backwards without torch-function modes."""
    x = torch.ones(3, requires_grad=True)

    def read(grad):
        grad.tolist()
        torch.tensor([0], device=grad.device)
        grad.sum().item()
        torch.tensor([1])  # host data
        grad.to("cpu")

    def hook(p):
        p.grad.tolist()

    x.register_post_accumulate_grad_hook(hook)
    with HostSyncRecorder() as rec:
        Once.apply(x * 2, read).sum().backward()
    kinds = sorted(s.kind for s in rec.syncs)
    expected = ["tolist", "torch.tensor(data, device=...)", "aten::_local_scalar_dense"]
    assert kinds == sorted([*expected, "tolist", ".to(cpu)"]), rec.report()
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the wrappers are gone
    assert torch.Tensor.to is torch._C.TensorBase.to


def test_the_report_says_what_and_where():
    def fn():
        return D.sum().item()

    with HostSyncRecorder() as rec:
        for _ in range(2):
            fn()
    text = rec.report()
    assert rec.count("item") == rec.count() == 2
    assert (
        text.startswith("2 host sync(s)")
        and "2x item at tests/training/test_host_syncs.py:" in text
    )
    assert " fn <" in text


# -- one training step per layout -----------------------------------------------------------
SMALL = ["model.num_layers=2", "trainer.micro_batch_size=4"]  # quick: 2 blocks, 1-2 microbatches
MOE = [*SMALL, "model.moe.num_experts=4", "model.moe.top_k=2"]
STEPS = 4  # step 1 logs, step 2 saves (where checkpointed), step 3 is recorded, step 4 logs
RECORDED = 3


def record_step_of_fit(trainer, rec: HostSyncRecorder, step: int) -> None:
    """Run ``trainer.fit()`` with ``rec`` recording from the start of ``step`` to the start of
    the next (or the end of the run); the recorder is left however the run ends."""
    inner = trainer.train_step
    with contextlib.ExitStack() as region:

        def train_step():
            n = trainer.state.step + 1
            if n == step:
                region.enter_context(rec)
                if getattr(trainer, "stop", None):  # the stop check's gloo flag, posted before
                    rec.mark(trainer.stop.posted_code, host=True)
            elif n == step + 1:
                region.close()
            return inner()

        trainer.train_step = train_step
        trainer.fit()


def _syncs_of_a_step(rank, world, overrides, saving=False):
    """Host syncs of step ``RECORDED`` of a ``fit`` with the loop's bookkeeping after it (the
    stop check that does not stop; with ``saving``, the poll of step 2's asynchronous save),
    and the forwards of mixture-of-experts blocks it ran. Step 3 is not the first step, nor a
    log, eval, checkpoint or stop step: those read the device on purpose (the log line's values
    and timers, an evaluation's loss, a save's snapshot, the step a stop saves) and are not
    covered here."""
    trainer = build_trainer(
        rank, world, overrides, STEPS, stop=StopRequest(), saving=saving or None
    )
    rec = HostSyncRecorder(trainer.topo.device)
    moe_forwards = [0]

    def count_forward(*_):
        moe_forwards[0] += trainer.state.step + 1 == RECORDED

    for layer in trainer.moe_layers:
        layer.register_forward_pre_hook(count_forward)
    try:
        record_step_of_fit(trainer, rec, RECORDED)
    finally:
        if trainer.saver is not None:
            trainer.saver.join_writer()
    if saving:
        assert trainer.saver.last_published.endswith("step_0000002")  # published by the poll
    return len(rec.syncs), rec.report(), moe_forwards[0]


DENSE = {
    "tp2-sp": [*SMALL, "parallel.tp=2", "parallel.sp=true"],
    "pp2-vpp2": ["trainer.micro_batch_size=4", "parallel.pp=2", "parallel.vpp=2"],
    "dp2-zero0": [*SMALL, "parallel.zero_stage=0"],
    "dp2-zero1": [*SMALL, "parallel.zero_stage=1"],
    "dp2-zero2": [*SMALL, "parallel.zero_stage=2"],
    "dp2-zero3": [*SMALL, "parallel.zero_stage=3"],
    "cp2": [*SMALL, "parallel.cp=2"],
}
MOE_LAYOUTS = {
    "ep2": [*MOE, "parallel.ep=2"],
    "ep2-capacity": [*MOE, "parallel.ep=2", "model.moe.capacity_factor=1.0"],
    "tp2-sp": [*MOE, "parallel.tp=2", "parallel.sp=true"],  # ep = 1: no all-to-all
    # Megatron-LM's order, tokens dropped per tp rank: the counts of both tp ranks in one read
    "tp2-sp-ep-first-capacity": [
        *MOE,
        "parallel.tp=2",
        "parallel.sp=true",
        "parallel.moe_dispatch_order=ep_first",
        "model.moe.capacity_factor=1.0",
    ],
    # fp8 experts: the weight grad's padded groups are placed on the device, from the offsets
    "ep2-fp8": [*MOE, "parallel.ep=2", "trainer.precision=bf16", "trainer.fp8=rowwise"],
    # DeepSeek-V3's router: the bias's update after the backward reads nothing on the host
    "ep2-balanced": [
        *MOE,
        "parallel.ep=2",
        "model.moe.router.score=sigmoid",
        "model.moe.router.bias_update_rate=0.001",
        "model.moe.router.num_groups=2",
        "model.moe.router.max_groups=1",
    ],
}


CHECKPOINTED = "dp2-zero1"  # also saves asynchronously at step 2: step 3 polls the write


@pytest.mark.parametrize("name", list(DENSE))
def test_a_dense_step_reads_the_device_at_most_once(name, tmp_path):
    """The one read: the previous step's loss and grad norm, once this step's work is queued
    (none where step 2's checkpoint settled step 2 already)."""
    overrides, saving = DENSE[name], name == CHECKPOINTED
    if saving:
        overrides = [
            *overrides,
            f"checkpoint.dir={tmp_path}",
            "checkpoint.interval=2",
            "checkpoint.async_save=true",
        ]
    for syncs, report, _ in run_world(_syncs_of_a_step, 2, overrides, saving):
        assert syncs <= (0 if saving else 1), report


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_a_moe_step_reads_the_device_once_per_block_forward(name):
    """Each block's forward copies all its counts to the host once (as Megatron-LM does); the
    step's own read comes on top."""
    for syncs, report, forwards in run_world(_syncs_of_a_step, 2, MOE_LAYOUTS[name]):
        assert forwards > 0
        assert syncs <= 1 + forwards, report


def test_a_skip_is_learned_when_read_or_during_the_next_step():
    """Step 2's non-finite grads make its update a no-op on the device; the host counts the skip
    only during step 3, which then stops the run at the limit before its own update."""
    trainer = build_trainer(0, 1, [*SMALL, "trainer.max_skipped_steps=1"], steps=4)
    first = next(trainer.chunks[0].parameters())
    first.register_hook(lambda g: g * float("nan") if trainer.state.step == 1 else g)
    trainer.train_step()
    second = trainer.train_step()
    assert not second.settled and trainer.state.skipped_steps == 0
    assert trainer.optimizer.step_count == 1  # decided on the device: step 2 applied nothing
    with pytest.raises(TooManySkippedSteps, match="stopping at step 2: 1 steps in a row"):
        trainer.train_step()
    assert second.skipped and trainer.state.skipped_steps == 1 and trainer.state.step == 2
    assert trainer.optimizer.step_count == 1  # step 3's update never ran


class FailingFit:
    """A stand-in trainer whose step 3 raises."""

    def __init__(self):
        self.state = SimpleNamespace(step=0)

    def train_step(self):
        if self.state.step == 2:
            raise RuntimeError("step 3 failed")
        self.state.step += 1

    def fit(self):
        while self.state.step < STEPS:
            self.train_step()


def test_a_failing_recorded_step_leaves_no_mode_or_wrapper_installed():
    with pytest.raises(RuntimeError, match="step 3 failed"):
        record_step_of_fit(FailingFit(), HostSyncRecorder(), RECORDED)
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0


# -- the host learns a step's values through an event on CUDA -------------------------------
class CopiedWhenWaited:
    """A GPU-like copy layer: a copy's host buffer holds nan until an event recorded after it is
    waited for, and a buffer's key is never reused before it was read."""

    def __init__(self):
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host dst, src as queued)
        self.done = 0
        self.unread: set[str] = set()
        self.keys: dict[int, str] = {}  # id of a host buffer -> its key
        self.follows = False

    def follow_training(self) -> None:
        self.follows = True

    def to_host(self, src: torch.Tensor, key: str) -> torch.Tensor:
        assert self.follows, "a copy queued before the side stream waited for training"
        assert key not in self.unread, f"{key} reused before it was read"
        dst = torch.full(src.shape, float("nan"), dtype=src.dtype)
        self.queue.append((dst, src.detach().clone()))  # what a stream copy would read
        self.unread.add(key)
        self.keys[id(dst)] = key
        return dst

    def record(self):
        layer, upto = self, len(self.queue)

        class Event:
            def synchronize(self) -> None:
                for dst, src in layer.queue[layer.done : upto]:
                    dst.copy_(src, non_blocking=True)  # the device's copy: no host read
                    layer.unread.discard(layer.keys[id(dst)])
                layer.done = max(layer.done, upto)

            def query(self) -> bool:
                return layer.done >= upto

        return Event()


def test_settle_waits_for_the_copy_event_and_reads_no_device_value():
    """On CUDA, settling a step reads its pinned host copy after the copy's event, never the
    device tensor (that read would wait for everything queued since, the next step's forward
    and backward included)."""
    trainer = build_trainer(0, 1, [*SMALL, "trainer.global_batch_size=4"], steps=3)
    trainer.readback = layer = CopiedWhenWaited()
    first = trainer.train_step()
    assert not first.settled and layer.done == 0 and layer.queue[0][0].isnan().all()
    expected = first.on_device.tolist()
    with HostSyncRecorder() as rec:
        rec.mark([dst for dst, _ in layer.queue], host=True)  # pinned host buffers
        trainer.settle()
    assert rec.syncs == [], rec.report()
    assert [first.loss, first.grad_norm] == expected  # the same values, copied
    second = trainer.train_step()  # reuses the first step's host buffer, read by now
    assert second.loss == second.loss and layer.done == 2  # waited for: not nan
    assert trainer.state.skipped_steps == 0 and len(trainer.state.history) == 2
