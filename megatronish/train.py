"""Entry point: ``python -m megatronish.train [+experiment=NAME] [key=value ...]``.

The same command runs one process, under ``torchrun`` and under ``srun`` (one task per rank):
compose the config (Hydra) -> validate -> start process groups -> build -> train -> save.
``--cfg job`` prints the composed config; ``trainer.dry_run=true`` prints the resolved config
and derived values, then exits.

Exit codes: 0 done, 2 invalid config, 3 bad data or a failure reported by another rank,
4 stopped early by a signal or ``trainer.exit_after_minutes`` with a checkpoint saved (the next
launch resumes from it; see docs/operations.md; a stop signal during start-up, from the first
line of this module on, stops before anything is built), 5 ``trainer.max_skipped_steps`` steps
in a row had a non-finite loss or grad norm (nothing saved since the fault), 6 a collective
failed or timed out (a peer rank died or hangs; the message names the group and op; also on
NCCL, see megatronish/distributed/nccl_errors.py), 7 the run in ``checkpoint.dir`` is already
complete (nothing to train), 130 aborted by a second Ctrl-C or one during start-up (imports
included; one line, no traceback), where a first Ctrl-C in training stops gracefully (exit 4).
A config that differs from the run saved in ``checkpoint.dir`` in keys that change the run is
refused with the differences, exit 2 (docs/operations.md, "Runs and resumes").
A CUDA error is a device fault: exit 1, traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import TYPE_CHECKING

from megatronish.training.startup_signals import (
    ABORTED,
    EXIT_ABORTED,
    StartupSignals,
    ctrl_c_aborts,
)

# Run as `python -m megatronish.train`: from here on a stop signal is recorded (a stop once the
# process groups exist) and a Ctrl-C while torch and Hydra import is one line and exit 130.
_STARTUP = StartupSignals.install() if __name__ == "__main__" else None
with ctrl_c_aborts(enabled=__name__ == "__main__"):
    import hydra
    import torch
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatronish.checkpoint.format import CheckpointError
    from megatronish.checkpoint.run_identity import ConfigChanged, RunComplete
    from megatronish.config.cli_errors import composition_error_reason, repeated_keys_reason
    from megatronish.config.compose import CONFIG_DIR
    from megatronish.config.derived import derive, pad_vocab
    from megatronish.config.schema import TrainConfig, register_configs
    from megatronish.config.sweep import sweep_job_dir, swept_keys
    from megatronish.config.validate import ConfigError, config_errors
    from megatronish.config.value_rules import config_notes
    from megatronish.distributed.agree import PeerError, agree
    from megatronish.distributed.comm import CollectiveError
    from megatronish.distributed.launch import LaunchEnv, detect_launch
    from megatronish.distributed.nccl_errors import describe_comm_error, failed_groups_message
    from megatronish.distributed.parallel_grid import ParallelGrid, rank_map_table
    from megatronish.distributed.shutdown import shutdown_process_groups
    from megatronish.training.numerics import StepResult, TooManySkippedSteps
    from megatronish.training.stop import StopRequest

if TYPE_CHECKING:
    from megatronish.checkpoint.resume import ResumePlan
    from megatronish.training.job import Job
    from megatronish.training.progress import ProgressLogger

EXIT_CONFIG = 2
EXIT_DATA = 3
EXIT_STOPPED = 4
EXIT_NONFINITE = 5
EXIT_COMM = 6
EXIT_COMPLETE = 7
# EXIT_ABORTED (130, from startup_signals): Ctrl-C twice, or once during start-up
SHUTDOWN_WAIT_S = 30.0  # the longest wait for process-group threads to end at exit
# The shortest: joining the groups' threads takes seconds on a loaded host (3.4 s measured with
# 2 cores shared by 4 ranks), also when collective_timeout_s is shorter than that.
SHUTDOWN_MIN_WAIT_S = 10.0


def dry_run_report(cfg: TrainConfig, world_size: int) -> str:
    """The resolved config and every derived value, as printed by ``trainer.dry_run=true``."""
    from megatronish.config.pipeline_rules import resolve_pipeline_schedule
    from megatronish.model.flops import active_parameters, count_parameters, flops_per_token
    from megatronish.plan.vocab import planned_vocab
    from megatronish.spec import ModelSpec

    d, p = derive(cfg, world_size), cfg.parallel
    vocab = planned_vocab(cfg)  # reads no data: an indexed corpus's tokenizer may not exist yet
    spec = ModelSpec.from_config(cfg.model, vocab.size)
    lines = [OmegaConf.to_yaml(cfg).rstrip(), "", "derived:"]
    values = {
        "world_size": world_size,
        "layout": f"tp={cfg.parallel.tp} cp={cfg.parallel.cp} pp={cfg.parallel.pp} "
        f"vpp={cfg.parallel.vpp} dp={d.dp}"
        + (f" ep={cfg.parallel.ep}" if cfg.parallel.ep > 1 else ""),
        **(
            {"pipeline_schedule": resolve_pipeline_schedule(p.pipeline_schedule, p.vpp)}
            if p.pp > 1
            else {}
        ),
        "microbatches_per_step": d.num_microbatches,
        "tokens_per_step": d.tokens_per_step,
        "vocab_size": f"{spec.vocab_size} ({vocab.source})",
        "padded_vocab_size": pad_vocab(spec.vocab_size, cfg.model.make_vocab_size_divisible_by),
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_query_groups": spec.num_kv_heads,
        "layers_per_chunk": list(d.layers_per_chunk),
        "parameters": f"{count_parameters(spec):,}",
        **({"active_parameters": f"{active_parameters(spec):,}"} if spec.moe else {}),
        "model_flops_per_step": f"{flops_per_token(spec) * d.tokens_per_step:.3e}",
    }
    lines += [f"  {k}: {v}" for k, v in values.items()]
    if world_size <= 64:  # larger maps are printed at start-up by rank 0
        lines += ["", rank_map_table(ParallelGrid.from_config(cfg.parallel, world_size))]
    return "\n".join(lines)


def run(cfg: TrainConfig, stop: StopRequest | None = None, launch: LaunchEnv | None = None):
    """Train with a composed, validated config; returns the trainer's step results on this rank.

    Once the process groups exist the ranks agree on ``stop`` (one all-reduce): a stop signal
    any of them got during start-up ends the run there, before anything is built, with
    ``stop.reason`` set (the caller's exit code 4). ``launch``: the launcher's environment
    (read from this process's when not given). Raises
    :class:`~megatronish.checkpoint.run_identity.ConfigChanged` or
    :class:`~megatronish.checkpoint.run_identity.RunComplete` on every rank, before building
    anything, when ``checkpoint.dir`` holds another run or this one complete.
    """
    from megatronish.training.job import start_topology

    launch = launch or detect_launch()
    derived, topo = start_topology(cfg, launch)
    try:
        if stop is not None and _stop_before_training(stop, topo):
            return []
        return _train(cfg, launch, topo, derived, stop)
    finally:
        topo.close()  # its process groups are destroyed by main_with_config


def _stop_before_training(stop: StopRequest, topo) -> bool:
    """Collective: whether the ranks agree to stop before building anything (a stop signal
    reached one of them while it started); rank 0 says so."""
    reason = stop.agreed(topo.world_group)
    if reason is not None and topo.rank == 0:
        print(f"stopping before training ({reason}): nothing trained, nothing to save", flush=True)
    return reason is not None


def _train(cfg: TrainConfig, launch: LaunchEnv, topo, derived, stop: StopRequest | None):
    from megatronish.checkpoint.resume import plan_resume, start_run
    from megatronish.training.job import build_on

    label = f"{cfg.name} ({launch.run_id})" if launch.run_id else cfg.name
    # Locks checkpoint.dir for this run, checks every rank can write there, tidies it up.
    with plan_resume(cfg.checkpoint, topo.world_group, label) as plan:
        for name in plan.restored:
            print(f"restored {name}, moved aside by an interrupted save", flush=True)
        for name in plan.removed:
            print(f"removed {name}, left by an interrupted save", flush=True)
        run_id = start_run(plan, OmegaConf.to_container(cfg, resolve=True), topo.world_group)
        logger = _start_logging(cfg, topo, run_id)
        try:
            job = build_on(cfg, launch, topo, derived)
            _save_config(cfg, topo)
            return _fit_and_save(cfg, job, plan, run_id, logger, stop)
        finally:
            logger.close()


def _start_logging(cfg: TrainConfig, topo, run_id: str):
    """Collective: the run's ProgressLogger (its log file and W&B run on the rank that holds the
    loss); a log file that cannot be written stops every rank with one line."""
    from megatronish.config.pipeline_rules import V_SHAPE_SCHEDULES
    from megatronish.model.build import holds_last_chunk
    from megatronish.training.progress import ProgressLogger

    p = cfg.parallel
    v = p.pipeline_schedule in V_SHAPE_SCHEDULES
    holds_loss = holds_last_chunk(topo.coords.pp, topo.pp, p.vpp, v)
    loss_rank = holds_loss and topo.coords.tp == topo.coords.dp == topo.coords.cp == 0
    logger, error = None, None
    try:
        logger = ProgressLogger(cfg, enabled=loss_rank, run_dir=cfg.out_dir, run_id=run_id)
    except OSError as e:
        error = (
            f"cannot write logging.log_file={cfg.logging.log_file} ({e.strerror}); give a "
            "writable path, or null for no log file"
        )
    try:
        agree(error, topo.world_group)
    except PeerError:
        if logger is not None:
            logger.close()
        raise
    return logger


def _save_config(cfg: TrainConfig, topo) -> None:
    """Collective: rank 0 writes ``out_dir/config.yaml`` (the resolved config of this launch, the
    only file written outside checkpoints and logging); a failure stops every rank."""
    error = None
    if topo.rank == 0:
        path = os.path.join(cfg.out_dir, "config.yaml")
        try:
            os.makedirs(cfg.out_dir, exist_ok=True)
            OmegaConf.save(cfg, path, resolve=True)
        except OSError as e:
            error = f"cannot write {path} ({e.strerror}); give a writable out_dir"
    agree(error, topo.world_group)


def _fit_and_save(
    cfg: TrainConfig,
    job: Job,
    plan: ResumePlan,
    run_id: str,
    logger: ProgressLogger,
    stop: StopRequest | None,
) -> list[StepResult]:
    from megatronish.checkpoint.resume import load_with_fallback
    from megatronish.checkpoint.save import Saving
    from megatronish.plan.devices import peak_precision
    from megatronish.training.peaks import device_peak_flops
    from megatronish.training.startup import log_startup
    from megatronish.training.trainer import Trainer

    topo, ckpt = job.topo, cfg.checkpoint
    precision = peak_precision(cfg.trainer.precision, cfg.trainer.fp8)
    peak = device_peak_flops(topo.device, precision, cfg.trainer.peak_tflops)
    saving = None
    if ckpt.dir:
        tokens = job.tokenizer.special_token_ids() if job.tokenizer is not None else None
        saving = Saving(run_id, tokens)
    trainer = Trainer(
        cfg,
        topo,
        job.spec,
        job.derived,
        job.chunks,
        job.train_data,
        job.valid_data,
        logger=logger,
        peak_flops=peak,
        saving=saving,
        stop=stop,
        rng=job.rng,
        eod_id=None if job.tokenizer is None else job.tokenizer.eod_id,
    )
    load_with_fallback(trainer.checkpoint_parts, plan, log=logger.info)
    log_startup(cfg, job, trainer, logger)
    with stop or contextlib.nullcontext():
        try:
            history = trainer.fit()
        except TooManySkippedSteps:
            if trainer.saver is not None:
                trainer.saver.wait()  # a save started before the fault (every rank stops here)
            raise
        finally:
            if trainer.saver is not None:
                trainer.saver.join_writer()  # no file writes left running at exit
        if (failed := failed_groups_message(topo.groups.values())) is not None:
            raise CollectiveError(failed)  # an NCCL op of the last step failed after its wait
        if trainer.saver is not None:
            trainer.saver.wait()
            done = trainer.saver.last_published or ""
            final = ckpt.save_final and not done.endswith(f"{trainer.state.step:07d}") and history
            # save() refuses (one line) while the last steps were skipped: state may be poisoned
            if final and (path := trainer.saver.save(blocking=True)) is not None:
                logger.info(f"saved checkpoint {path}")
    return history


def main_with_config(
    cfg: TrainConfig, launch: LaunchEnv | None = None, startup: StartupSignals | None = None
) -> int:
    """Validate, dry-run or train; returns the process exit code. Never raises for user errors.

    ``launch``: the launcher's environment (read from this process's when not given);
    ``startup``: the stop signals recorded since the process started (``python -m``).
    """
    launch = launch or detect_launch()
    prefix = f"[rank {launch.rank}] " if launch.world_size > 1 else ""
    world = launch.world_size
    if cfg.world_size is not None and cfg.trainer.dry_run:
        world = cfg.world_size
    cuda = None if cfg.trainer.dry_run else torch.cuda.is_available()
    errors = config_errors(cfg, world, cuda_available=cuda, data=not cfg.trainer.dry_run)
    if cfg.world_size is not None and not cfg.trainer.dry_run and cfg.world_size != world:
        errors.append(
            f"world_size={cfg.world_size} but the job was launched with {world} rank(s); "
            "drop world_size (it is for dry runs and the planner)"
        )
    if errors:
        if launch.rank == 0:
            print(f"{prefix}{ConfigError(errors)}", file=sys.stderr, flush=True)
        else:
            print(f"{prefix}invalid config: {errors[0]}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if launch.rank == 0:
        for note in config_notes(cfg, cuda_available=cuda):
            print(f"note: {note}", flush=True)
    if cfg.trainer.dry_run:
        from megatronish.plan.vocab import VocabError

        try:
            report = dry_run_report(cfg, world)
        except VocabError as e:
            print(f"{prefix}invalid config: {e}", file=sys.stderr, flush=True)
            return EXIT_CONFIG
        if launch.rank == 0:
            print(report, flush=True)
        return 0
    try:
        # The exit_after_minutes clock starts here; local rank 0 says what Ctrl-C does.
        stop = StopRequest.from_config(cfg.trainer, notice=launch.local_rank == 0)
    except ConfigError as e:
        print(f"{prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    code = 1  # an unexpected error: its traceback follows
    stop.take_over(startup)  # a stop signal from here on stops the run, also during start-up
    try:
        code = _run_and_report(cfg, stop, launch, prefix)
    finally:
        stop.uninstall()
        _end_process_groups(cfg, code, prefix)
    if code == 0 and stop.reason is not None:
        if launch.rank == 0:
            print(f"stopped early ({stop.reason}), exit code {EXIT_STOPPED}", flush=True)
        return EXIT_STOPPED
    return code


def _run_and_report(cfg: TrainConfig, stop: StopRequest, launch: LaunchEnv, prefix: str) -> int:
    """Train; a failure a user can act on is one line on stderr and its exit code."""
    try:
        run(cfg, stop, launch)
    except ConfigError as e:
        print(f"{prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except ConfigChanged as e:
        print(f"{prefix}refused: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except RunComplete as e:
        if launch.rank == 0:
            print(
                f"{cfg.name}: {e}. To train it longer raise trainer.max_steps (with "
                f"scheduler.decay_steps={e.step} unless it is set, to keep its schedule), or give "
                f"a new run its own directory (name=NEW_NAME); exit code {EXIT_COMPLETE}",
                flush=True,
            )
        return EXIT_COMPLETE
    except KeyboardInterrupt:
        print(f"{prefix}{ABORTED}", file=sys.stderr, flush=True)
        return EXIT_ABORTED
    except (PeerError, FileNotFoundError, CheckpointError) as e:
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return EXIT_DATA
    except TooManySkippedSteps as e:
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except CollectiveError as e:
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return EXIT_COMM
    except RuntimeError as e:  # a torch.distributed / NCCL error outside the comm wrappers
        if (why := describe_comm_error(e)) is None:
            raise
        print(f"{prefix}error: {why}", file=sys.stderr, flush=True)
        return EXIT_COMM
    return 0


def _end_process_groups(cfg: TrainConfig, code: int, prefix: str) -> None:
    """Destroy every process group before returning (see megatronish/distributed/shutdown.py).

    When some of their threads are still there after the wait (a worker in an op with a peer
    that is gone, or groups torch's profiler keeps), the process ends here with ``code``,
    skipping the interpreter's finalization, which could abort with those threads running.
    """
    wait_s = max(SHUTDOWN_MIN_WAIT_S, cfg.parallel.collective_timeout_s)
    why = shutdown_process_groups(min(SHUTDOWN_WAIT_S, wait_s))
    if why is None:
        return
    if sys.exc_info()[0] is not None:
        traceback.print_exc()
    if cfg.trainer.profile.steps:
        why += " (torch's profiler keeps the groups whose ops it recorded)"
    print(
        f"{prefix}note: {why}; exiting with code {code} without finalizing the interpreter",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(code)


def main(startup: StartupSignals | None = None) -> None:
    """Compose with Hydra and run; a composition error is one line on stderr and exit 2.

    ``startup``: the stop signals recorded since the process started (``python -m``)."""
    register_configs()
    launch = detect_launch()
    prefix = f"[rank {launch.rank}] " if launch.world_size > 1 else ""
    if (repeated := repeated_keys_reason(sys.argv[1:])) is not None:
        print(f"{prefix}invalid config: {repeated}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    started = []
    swept = swept_keys(sys.argv[1:])

    def task(cfg: DictConfig) -> None:
        sweep_job = sweep_job_dir(cfg.out_dir, swept)
        if sweep_job is not None:  # a -m sweep: this job's own run directory
            cfg.out_dir = sweep_job
        OmegaConf.resolve(cfg)  # an interpolation error is a composition error
        started.append(True)
        code = main_with_config(cfg, launch, startup)
        if code and not (sweep_job is not None and code == EXIT_COMPLETE):
            sys.exit(code)  # a complete job of a sweep goes on to the next one

    show_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises composition errors instead of printing
    try:
        hydra.main(config_path=CONFIG_DIR, config_name="train", version_base=None)(task)()
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        # ValueError: Hydra's for an override such as trainer=4 (a group needs a name)
        if show_traceback or started:  # a failure of the run, not of composing the config
            raise
        print(f"{prefix}invalid config: {composition_error_reason(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    finally:
        if not show_traceback:
            os.environ.pop("HYDRA_FULL_ERROR", None)


if __name__ == "__main__":
    with ctrl_c_aborts():  # before the process groups exist (the run catches its own)
        main(_STARTUP)
