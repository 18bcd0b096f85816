"""The training loop: microbatches -> forward/backward -> grad sync -> clip -> step -> log.

``trainer.precision=bf16`` trains bf16 params and activations against fp32 main params and
grads (see :mod:`megatronish.data_parallel.zero`); there is no autocast.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from megatronish.checkpoint.host_copies import HostCopies, StreamCopies
from megatronish.checkpoint.parts import CheckpointParts, model_buffers
from megatronish.checkpoint.save import CheckpointSaver, Saving
from megatronish.config.derived import Derived
from megatronish.config.pipeline_rules import (
    SPLIT_BACKWARD_SCHEDULES,
    V_SHAPE_SCHEDULES,
    resolve_pipeline_schedule,
)
from megatronish.config.schema import TrainConfig
from megatronish.context_parallel.split import split_sequence
from megatronish.data.documents import (
    DocumentPacking,
    attention_pairs,
    kept_targets,
    loss_divisor,
)
from megatronish.data_parallel.compression import CompressionSettings
from megatronish.data_parallel.offload import Transfers
from megatronish.data_parallel.zero import ZeroDataParallel
from megatronish.distributed.comm import all_reduce
from megatronish.distributed.p2p import BatchedP2P
from megatronish.distributed.timers import Timers, device_sync, max_min_over_ranks, timer_metrics
from megatronish.distributed.topology import Topology
from megatronish.model.build import holds_last_chunk
from megatronish.model.flops import flops_per_token, split_backward_times
from megatronish.moe import metrics as moe
from megatronish.optim.lr_schedule import schedule_from_config
from megatronish.optim.sharded_adamw import ShardedAdamW
from megatronish.pipeline.engine import (
    PipelineShape,
    Timeline,
    attach_split_backward,
    forward_backward_pipeline,
    forward_only_pipeline,
)
from megatronish.pipeline.microbatch import Microbatch, microbatch_parts, run_chunk
from megatronish.pipeline.no_pipeline import forward_backward_no_pipeline
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.tensor_parallel.weight_grad import WeightGradStore
from megatronish.training.numerics import (
    StepResult,
    TooManySkippedSteps,
    queue_host_copy,
    read_on_host,
    skip_limit_message,
)
from megatronish.training.peaks import PeakMemory
from megatronish.training.precision import DTYPES
from megatronish.training.prefetch import BatchPrefetcher, HostBatches
from megatronish.training.profiling import StepProfiler
from megatronish.training.progress import ProgressLogger, format_startup_memory
from megatronish.training.stop import StopRequest


@dataclass
class TrainState:
    """What resume needs besides model and optimizer tensors."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    skipped_in_a_row: int = 0  # 0 at every save: steps in a skip streak are never saved
    history: list[StepResult] = field(default_factory=list)  # every settled step, in order


class Trainer:
    """Runs optimizer steps over a sample stream addressed by a global cursor."""

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        spec: ModelSpec,
        derived: Derived,
        chunks: list[nn.Module],
        train_data,
        valid_data=None,
        *,
        logger: ProgressLogger | None = None,
        peak_flops: float | None = None,
        forward_backward=None,
        p2p=None,
        saving: Saving | None = None,
        stop: StopRequest | None = None,
        rng: RNGTracker | None = None,
        eod_id: int | None = None,
        transfers: Transfers | None = None,
    ):
        """``saving``: checkpoints go to ``checkpoint.dir`` (periodic, final and asynchronous
        saves from :meth:`fit`); ``stop``: a :class:`StopRequest` asked at every step boundary;
        ``rng``: the model's RNG streams, which checkpoints save and a load restores (None:
        neither); ``eod_id``: the tokenizer's end-of-document id (packed-document options);
        ``transfers``: optimizer offload's copy layer (None: the device's own)."""
        self.cfg, self.topo, self.spec, self.derived = cfg, topo, spec, derived
        self.chunks = chunks
        self.train_data, self.valid_data = train_data, valid_data
        # data.reset_attention_mask / reset_position_ids / eod_mask_loss (None: all off)
        self.packing = DocumentPacking.from_config(cfg.data, eod_id)
        self.logger = logger or ProgressLogger(cfg, enabled=False, run_dir=".")
        # The start-up's peak, then each progress line's steps (measured where they are printed).
        self.memory = PeakMemory(topo.device, sample=self.logger.enabled)
        self.peak_flops = peak_flops
        p, o = cfg.parallel, cfg.optimizer
        self.timers = Timers(cfg.logging.timers, device_sync(topo.device))
        prof = cfg.trainer.profile
        self.profiler = StepProfiler(prof.steps, prof.dir, topo.rank, topo.device, self.timers)
        self.param_dtype = DTYPES[cfg.trainer.precision]
        self.zero = ZeroDataParallel(
            chunks,
            topo,
            p.zero_stage,
            p.bucket_size_mb,
            keep_gathered=p.zero3_keep_gathered,
            timers=self.timers,
            param_dtype=self.param_dtype,
            reduce_dtype=DTYPES[p.grad_reduce_dtype],
            overlap_param_gather=p.overlap_param_gather,
            compression=CompressionSettings.of(p),
            seed=cfg.trainer.seed,
            optimizer_offload=p.optimizer_offload,
            transfers=transfers,
        )
        self.optimizer = ShardedAdamW(
            [shard.numel() for shard, _, _ in self.zero.optimizer_shards()],
            self.zero.optimizer_device,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.lr_at = schedule_from_config(cfg.optimizer, cfg.scheduler, cfg.trainer.max_steps)
        self.timeline: Timeline | None = None
        # Pipeline p2p: a factory ``group -> P2PCommunicator`` (default: batched isend/irecv).
        self.p2p = p2p or BatchedP2P
        self.forward_backward = forward_backward or self._default_forward_backward()
        self.state = TrainState()
        self._unsettled: list[StepResult] = []  # steps whose values are still on the device
        # How a step's [loss, grad norm] reaches the host: a non-blocking copy into a pinned
        # buffer and an event on CUDA; None (a direct read at settle) on CPU. Tests inject one.
        self.readback: HostCopies | None = (
            StreamCopies(topo.device) if topo.device.type == "cuda" else None
        )
        # What checkpoints save and restore; the logger is looked up per line (tests swap it).
        self.checkpoint_parts = CheckpointParts(
            cfg,
            topo,
            spec,
            self.zero,
            self.optimizer,
            self.state,
            rng,
            settle=self.settle,
            drop_unsettled=self._drop_unsettled,
            log=lambda line: self.logger.info(line),
            buffers=model_buffers(chunks),
        )
        self.saver = (
            None
            if saving is None
            else CheckpointSaver(cfg, self.checkpoint_parts, saving.run_id, saving.special_tokens)
        )
        self.stop = stop
        schedule = resolve_pipeline_schedule(p.pipeline_schedule, p.vpp)
        self.pipeline_schedule = schedule
        self.holds_loss = holds_last_chunk(
            topo.coords.pp, topo.pp, p.vpp, schedule in V_SHAPE_SCHEDULES
        )
        # Zero-bubble schedules: the layers' weight grads wait here for the schedule's W.
        self.weight_grads: WeightGradStore | None = None
        if topo.pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
            self.weight_grads = WeightGradStore()
            attach_split_backward(chunks, self.weight_grads)
        self.prefetcher = BatchPrefetcher(
            lambda first: self._host_microbatches(self.train_data, first),
            cfg.trainer.global_batch_size,
            enabled=cfg.data.prefetch,
        )
        self.flops_per_step = flops_per_token(spec) * derived.tokens_per_step
        # With document masks each step's attention FLOPs follow its documents: the mean
        # document length per token of each step's batch, by its first sample (data thread).
        self._attention_spans: dict[int, float] = {}
        self._flops_since_log = 0.0
        self.moe_layers = moe.moe_layers(chunks)  # found once, not walked every step

    def pipeline_shape(self) -> PipelineShape:
        """The activation every stage sends: ``[s/cp (/tp with sp), micro batch, hidden]``."""
        s, tp = self.spec.seq_length // self.topo.cp, self.topo.tp
        seq = s // tp if self.cfg.parallel.sp and tp > 1 else s
        shape = (seq, self.cfg.trainer.micro_batch_size, self.spec.hidden_size)
        return PipelineShape(shape, self.param_dtype)

    def _default_forward_backward(self):
        if self.topo.pp == 1:
            return functools.partial(forward_backward_no_pipeline, timers=self.timers)

        op_times = split_backward_times(self.spec)

        def run(chunks, microbatches, **kw):
            return forward_backward_pipeline(
                chunks,
                microbatches,
                topo=self.topo,
                vpp=self.cfg.parallel.vpp,
                shape=self.pipeline_shape(),
                timeline=self.timeline,
                timers=self.timers,
                comm=self.p2p(self.topo.pp_group),
                schedule=self.pipeline_schedule,
                weight_grads=self.weight_grads,
                op_times=op_times,
                **kw,
            )

        return run

    # -- data -------------------------------------------------------------------------------
    def microbatches(self, data, first_sample: int) -> list[Microbatch]:
        """This dp rank's microbatches of the global batch that starts at ``first_sample``,
        cut to this cp rank's chunks of every sequence, on the device: ``(inputs, targets)``,
        and their :class:`Documents` third with packed-document options on."""
        return self._to_device(self._host_microbatches(data, first_sample))

    def _host_microbatches(self, data, first_sample: int) -> HostBatches:
        """:meth:`microbatches` in host memory (pinned when training on a GPU)."""
        t, topo, packing = self.cfg.trainer, self.topo, self.packing
        per_rank = t.global_batch_size // topo.dp
        start = first_sample + topo.coords.dp * per_rank
        samples = data if packing is None else packing.samples(data)
        divisor = None
        if packing is not None and (packing.eod_mask_loss or packing.reset_attention_mask):
            # every rank reads the whole batch's documents: the loss's token count, the FLOPs
            s, end = self.spec.seq_length, first_sample + t.global_batch_size
            whole = [samples[i][1] for i in range(first_sample, end)]
            if packing.eod_mask_loss:
                kept = sum(kept_targets(n, s) for n in whole)
                divisor = loss_divisor(kept, topo.dp_cp, self.derived.num_microbatches)
            if packing.reset_attention_mask and data is self.train_data:
                pairs = sum(attention_pairs(n, s) for n in whole)
                self._attention_spans[first_sample] = pairs / (len(whole) * s)
        out = []
        for m in range(self.derived.num_microbatches):
            first = start + m * t.micro_batch_size
            rows = [samples[i] for i in range(first, first + t.micro_batch_size)]
            batch = torch.stack(rows if packing is None else [tokens for tokens, _ in rows])
            inputs, targets = batch[:, :-1], batch[:, 1:]
            parts = [
                split_sequence(x, 1, topo.cp, topo.coords.cp).contiguous()
                for x in (inputs, targets)
            ]
            if packing is not None:
                parts.append(packing.microbatch(rows, topo.cp, topo.coords.cp, divisor))
            if topo.device.type == "cuda":
                parts = [x.pin_memory() for x in parts]
            out.append(tuple(parts))
        return out

    def _to_device(self, batches):
        device = self.topo.device
        return [tuple(x.to(device, non_blocking=True) for x in parts) for parts in batches]

    # -- one step ---------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One optimizer step, during which the host reads nothing of this step from the device.

        Clipping and the skip of a non-finite step are decided on the device. The result's
        loss, grad norm and skip are read when asked for (:class:`StepResult`), at the latest
        by the next step once its forward and backward are queued (:meth:`settle`); on CUDA
        their copy to the host is queued as soon as the norm is (:func:`queue_host_copy`).
        """
        step = self.state.step
        for c in self.chunks:
            c.train()
        with self.timers.region("data", "data"):  # prefetched during the previous step
            more = self.state.step + 1 < self.cfg.trainer.max_steps
            batches = self._to_device(self.prefetcher.get(self.state.consumed_samples, more))
        self._flops_since_log += self._step_flops(self.state.consumed_samples)
        self.zero.start_step(len(batches), step)
        moe.start_step(self.moe_layers, loss_scale=1.0 / len(batches))
        losses = self.forward_backward(
            self.chunks, batches, loss_scale=1.0 / len(batches), param_hooks=self.zero
        )
        self.zero.finish_reduction()
        moe.after_backward(self.moe_layers, self.spec, self.topo.world_group, self.topo.device)
        self.timers.start("optimizer", "optimizer")  # grad norm, clipping and the update
        # The previous step. On CUDA the host waits for that step's copy event, i.e. for its
        # own forward, backward and norm (done, or running with this step's work queued behind
        # them), not for this step's work; on CPU it reads the previous step's values directly.
        self.settle()
        loss = self._mean_loss(losses)
        # A non-finite loss (seen only where the loss lives) makes the global norm nan everywhere.
        norm = self.zero.grad_norm(local_fault=None if loss is None else ~torch.isfinite(loss))
        lr = self.lr_at(step)
        found_inf = (~torch.isfinite(norm)).float()  # the same on every rank: the norm is global
        max_norm, clip = self.cfg.optimizer.grad_clip, None
        if max_norm > 0:  # applied inside the update, no extra pass
            clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if loss is None:
            loss = torch.full_like(norm, float("nan"))
        pair = torch.stack([loss.float(), norm])
        copied = queue_host_copy(self.readback, pair)
        shards, clip, found_inf = self.zero.update_inputs(clip, found_inf)
        self.optimizer.step(shards, lr, grad_scale=clip, found_inf=found_inf)
        self.timers.stop("optimizer")
        self.zero.after_update()
        self.state.step += 1
        self.state.consumed_samples += self.cfg.trainer.global_batch_size
        result = StepResult(step + 1, lr, pair, self.settle, copied)
        self._unsettled.append(result)
        return result

    def _step_flops(self, first_sample: int) -> float:
        """Model FLOPs of the step whose batch starts at ``first_sample``."""
        span = self._attention_spans.pop(first_sample, None)
        if span is None:
            return self.flops_per_step
        spec = replace(self.spec, attended_keys=span)
        return flops_per_token(spec) * self.derived.tokens_per_step

    def settle(self) -> None:
        """Learn the unsettled steps' loss and grad norm on the host (:func:`read_on_host`), in
        order: add them to ``state.history``, count and log the skipped ones, and raise
        :class:`TooManySkippedSteps` at ``trainer.max_skipped_steps`` in a row. Every pending
        result is resolved before the accounting, so when it raises, the step that reached the
        limit and those after it (not in ``history``) still report their values."""
        pending, self._unsettled = self._unsettled, []
        if not pending:
            return
        values = read_on_host(pending)
        for result, (loss, norm) in zip(pending, values):
            result.resolve(loss, norm)
        for result, (loss, norm) in zip(pending, values):
            if result.skipped:  # the update was a no-op: the optimizer state is untouched
                self.state.skipped_steps += 1
                self.state.skipped_in_a_row += 1
                self._after_skipped_step(result.step, loss, norm)
            else:
                self.state.skipped_in_a_row = 0
            self.state.history.append(result)

    def _drop_unsettled(self) -> None:
        """Forget the unsettled steps: a load replaced the state they were run from, so a later
        settle must not count them (reading one raises)."""
        self._unsettled.clear()

    def _after_skipped_step(self, step: int, loss: float, norm: float) -> None:
        """Log a skipped step; raise :class:`TooManySkippedSteps` at the consecutive limit."""
        limit, in_a_row = self.cfg.trainer.max_skipped_steps, self.state.skipped_in_a_row
        stop_after = f"the run stops after {limit}" if limit else "no limit"
        self.logger.info(
            f"step {step} skipped: loss {loss}, grad norm {norm}; optimizer state unchanged "
            f"({in_a_row} in a row, {stop_after}; {self.state.skipped_steps} skipped in total)"
        )
        if limit and in_a_row >= limit:
            held = loss if self.holds_loss else None
            raise TooManySkippedSteps(skip_limit_message(step, limit, norm, held))

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | None:
        """Mean loss of the global batch on last-stage ranks, on the device (None elsewhere)."""
        if not self.holds_loss or not losses:
            return None
        mean = torch.stack(losses).float().mean()
        all_reduce(mean, self.topo.dp_cp_group)  # cp ranks: equal token counts, so a plain mean
        return mean / self.topo.dp_cp

    def evaluate(self) -> float:
        """Mean validation loss over ``trainer.eval_iters`` global batches."""
        return self._evaluate(self.valid_data)

    def evaluate_datasets(self) -> dict[str, float]:
        """A blend's validation loss per dataset, each over ``trainer.eval_iters`` global batches
        of that dataset alone (empty when the validation data is not a blend)."""
        if not hasattr(self.valid_data, "datasets"):
            return {}
        data = self.valid_data
        return {name: self._evaluate(ds) for name, ds in zip(data.names, data.datasets)}

    @torch.no_grad()
    def _evaluate(self, data) -> float:
        if data is None:
            return float("nan")
        for c in self.chunks:
            c.eval()
        losses = []
        for i in range(self.cfg.trainer.eval_iters):
            batches = self.microbatches(data, i * self.cfg.trainer.global_batch_size)
            if self.topo.pp > 1:
                losses += forward_only_pipeline(
                    self.chunks,
                    batches,
                    topo=self.topo,
                    vpp=self.cfg.parallel.vpp,
                    shape=self.pipeline_shape(),
                    param_hooks=self.zero,
                    comm=self.p2p(self.topo.pp_group),
                    schedule=self.pipeline_schedule,
                )
                continue
            for microbatch in batches:
                inputs, targets, documents = microbatch_parts(microbatch)
                self.zero.prefetch(0, "fwd")
                losses.append(run_chunk(self.chunks[0], inputs, targets, documents).detach())
                self.zero.after_compute(0, "fwd")
        self.zero.release_all()  # zero 3 with keep_gathered
        loss = self._mean_loss(losses)
        return float("nan") if loss is None else loss.item()

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> list[StepResult]:
        """Train until ``trainer.max_steps``; returns ``state.history``: every step this trainer
        settled, in order, also those of ``train_step()`` calls made before ``fit``."""
        try:
            return self._fit()
        finally:
            self.prefetcher.close()
            self.memory.close()

    def _fit(self) -> list[StepResult]:
        t, log_every = self.cfg.trainer, self.cfg.logging.log_interval
        startup = self.memory.startup()  # the build, ZeRO's buffers, a loaded checkpoint
        self.logger.info(format_startup_memory(startup, *self.memory.meanings))
        window_start, window_steps = time.perf_counter(), 0
        self.timers.reset()
        while self.state.step < t.max_steps:
            self.profiler.before_step(self.state.step + 1)
            result = self.train_step()
            self.timers.end_step()
            self._profiled(self.profiler.after_step(result.step))
            window_steps += 1
            step = result.step
            if step % log_every == 0 or step == t.max_steps or step == 1:
                self.settle()
                elapsed = time.perf_counter() - window_start
                self._log(result, elapsed / window_steps, self._flops_since_log / window_steps)
                self._flops_since_log = 0.0
                window_start, window_steps = time.perf_counter(), 0
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
                with self.timers.paused():
                    self.logger.log_eval(step, self.evaluate(), self.evaluate_datasets())
                # the next line's step time leaves the evaluation and the steps before it out
                window_start, window_steps = time.perf_counter(), 0
                self._flops_since_log = 0.0
            interval = self.cfg.checkpoint.interval
            if self.saver is not None and interval and step % interval == 0:
                self.settle()  # a step in a skip streak is not saved
            if self.saver is not None:
                self._checkpoint(step)
            if self.stop is not None and step < t.max_steps and self._stop_agreed(step):
                break
        self.settle()
        self._profiled(self.profiler.finish())
        return self.state.history

    def _stop_agreed(self, step: int) -> bool:
        """Collective (on the host): True when the ranks agree to stop now, after saving this
        step."""
        reason = self.stop.agreed_late(self.topo.world_group)
        if reason is None:
            return False
        self.settle()  # whether this step may be saved
        saved = "no checkpoint.dir, nothing saved"
        if self.saver is not None:
            path = self.saver.wait() or self.saver.last_published or ""
            if self.state.skipped_in_a_row:  # never save state a skip streak may poison
                saved = (
                    f"not saved: the last {self.state.skipped_in_a_row} step(s) were "
                    f"skipped; the last checkpoint is {path or 'none'}"
                )
            else:
                if not path.endswith(f"{step:07d}"):  # not already saved by the interval
                    path = self.saver.save(blocking=True)
                saved = f"saved checkpoint {path}"
        self.logger.info(f"stopping after step {step} ({reason}); {saved}")
        return True

    def _profiled(self, trace: str | None) -> None:
        if trace:
            others = " and one per rank next to it" if self.topo.world_size > 1 else ""
            self.logger.info(f"wrote profile {trace}{others}")

    def _checkpoint(self, step: int) -> None:
        with self.timers.region("checkpoint", "checkpoint poll"):
            published = self.saver.poll()
        if published:
            self.logger.info(f"saved checkpoint {published}")
        interval = self.cfg.checkpoint.interval
        due = interval and step % interval == 0 and step < self.cfg.trainer.max_steps
        if due and not self.state.skipped_in_a_row:  # never save state a skip streak may poison
            with self.timers.region("checkpoint", "checkpoint save"):
                published = self.saver.save()
            if published:
                self.logger.info(f"saved checkpoint {published}")

    def _timer_metrics(self) -> dict[str, float]:
        """The window's timers as max / min over ranks (collective: every rank, log steps only)."""
        world = self.topo.world_group
        max_min = max_min_over_ranks(
            self.timers.per_step(), lambda v: all_reduce(v, world, op="max"), self.topo.device
        )
        self.timers.reset()
        return timer_metrics(max_min)

    def moe_metrics(self) -> dict[str, float]:
        """Routing metrics of the last step (collective; empty for a dense model)."""
        if self.spec.moe is None:
            return {}
        return moe.step_metrics(
            self.moe_layers,
            self.spec.num_layers,
            self.spec.moe.num_experts,
            self.topo.world_group,
            self.topo.dp,
            self.derived.num_microbatches,
            self.topo.device,
        )

    def _log(self, r: StepResult, step_time: float, flops_per_step: float) -> None:
        """``step_time`` and ``flops_per_step``: means over the steps since the last line."""
        timers = self._timer_metrics()
        tokens_per_s = self.derived.tokens_per_step / step_time
        mfu = None
        if self.peak_flops:
            mfu = flops_per_step / step_time / (self.peak_flops * self.topo.world_size)
        self.logger.log_step(
            {
                "step": r.step,
                "loss": r.loss,
                "lr": r.lr,
                "grad_norm": r.grad_norm,
                "tokens_per_s": tokens_per_s,  # global: every rank's tokens
                "tokens_per_s_per_device": tokens_per_s / self.topo.world_size,
                "mfu": mfu,
                "step_time_s": step_time,
                "peak_memory": self.memory.take(),
                "skipped_steps": self.state.skipped_steps,
                **self.moe_metrics(),
                **timers,
            }
        )
