"""Entry point: ``python -m megatronish.train [+experiment=NAME] [key=value ...]``.

The same command runs one process, under ``torchrun`` and under ``srun`` (one task per rank):
compose the config (Hydra) -> validate -> start process groups -> build -> train -> save.
``--cfg job`` prints the composed config; ``trainer.dry_run=true`` prints the resolved config
and derived values, then exits.

Exit codes: 0 done, 2 invalid config, 3 bad data or a failure reported by another rank,
4 stopped early by a signal or ``trainer.exit_after_minutes`` with a checkpoint saved (the next
launch resumes from it; see docs/operations.md), 5 ``trainer.max_skipped_steps`` steps in a row
had a non-finite loss or grad norm (nothing saved since the fault), 6 a collective failed or
timed out (a peer rank died or hangs; the message names the group and op).
"""

from __future__ import annotations

import contextlib
import os
import sys

import hydra
import torch.distributed as dist
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatronish.checkpoint.format import CheckpointError
from megatronish.config.cli_errors import composition_error_reason
from megatronish.config.compose import CONFIG_DIR
from megatronish.config.derived import derive, pad_vocab
from megatronish.config.schema import register_configs
from megatronish.config.validate import ConfigError, config_errors
from megatronish.distributed.agree import PeerError
from megatronish.distributed.comm import CollectiveError
from megatronish.distributed.launch import detect_launch
from megatronish.numerics import TooManySkippedSteps
from megatronish.stop import StopRequest

EXIT_CONFIG = 2
EXIT_DATA = 3
EXIT_STOPPED = 4
EXIT_NONFINITE = 5
EXIT_COMM = 6


def tokenizer_vocab_size(data_cfg) -> int:
    """The tokenizer's vocabulary without building any data (for dry runs)."""
    if data_cfg.source == "indexed" and data_cfg.tokenizer_model:
        from megatronish.data.tokenizer import Tokenizer

        return Tokenizer(data_cfg.tokenizer_model).vocab_size
    return data_cfg.vocab_size


def dry_run_report(cfg, world_size: int) -> str:
    """The resolved config and every derived value, as printed by ``trainer.dry_run=true``."""
    from megatronish.metrics import count_parameters, flops_per_token
    from megatronish.model.spec import ModelSpec

    d = derive(cfg, world_size)
    vocab = tokenizer_vocab_size(cfg.data)
    spec = ModelSpec.from_config(cfg.model, vocab)
    lines = [OmegaConf.to_yaml(cfg).rstrip(), "", "derived:"]
    values = {
        "world_size": world_size,
        "layout": f"tp={cfg.parallel.tp} pp={cfg.parallel.pp} vpp={cfg.parallel.vpp} dp={d.dp}",
        "microbatches_per_step": d.num_microbatches,
        "tokens_per_step": d.tokens_per_step,
        "vocab_size": spec.vocab_size,
        "padded_vocab_size": pad_vocab(spec.vocab_size, cfg.model.make_vocab_size_divisible_by),
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_query_groups": spec.num_kv_heads,
        "layers_per_chunk": list(d.layers_per_chunk),
        "parameters": f"{count_parameters(spec):,}",
        "model_flops_per_step": f"{flops_per_token(spec) * d.tokens_per_step:.3e}",
    }
    lines += [f"  {k}: {v}" for k, v in values.items()]
    return "\n".join(lines)


def run(cfg, stop: StopRequest | None = None):
    """Train with a composed config; returns the trainer's step results on this rank.

    ``stop``'s signal handlers are installed for training and the final save only: a signal
    during start-up keeps its default action (there is nothing to save yet).
    """
    from megatronish.checkpoint.resume import load_with_fallback, plan_resume, saved_run_id
    from megatronish.checkpoint.save import CheckpointSaver
    from megatronish.job import build_job
    from megatronish.metrics import device_peak_flops
    from megatronish.progress import ProgressLogger
    from megatronish.trainer import Trainer

    launch = detect_launch()
    job = build_job(cfg, launch)
    topo = job.topo
    if topo.rank == 0:  # the only file written outside checkpoints and logging
        os.makedirs(cfg.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out_dir, "config.yaml"), resolve=True)
    ckpt = cfg.checkpoint
    plan = plan_resume(ckpt, topo.world_group)  # tidies up after an interrupted save
    for name in plan.restored:
        print(f"restored {name}, moved aside by an interrupted save", flush=True)
    for name in plan.removed:
        print(f"removed {name}, left by an interrupted save", flush=True)
    run_id = saved_run_id(plan) or f"{cfg.name}-{launch.run_id or 'local'}"
    loss_rank = topo.is_last_stage and topo.coords.tp == 0 and topo.coords.dp == 0
    logger = ProgressLogger(cfg, enabled=loss_rank, run_dir=cfg.out_dir, run_id=run_id)
    peak = device_peak_flops(topo.device, cfg.trainer.precision, cfg.trainer.peak_tflops)
    trainer = Trainer(
        cfg, topo, job.spec, job.derived, job.chunks, job.train_data, job.valid_data,
        logger=logger, peak_flops=peak,
    )  # fmt: skip
    if ckpt.dir:
        trainer.saver = CheckpointSaver(cfg, trainer, job.rng, run_id)
    load_with_fallback(trainer, plan, job.rng, cfg.trainer.seed, log=logger.info)
    logger.info(
        f"training {job.spec.arch} ({sum(p.numel() for c in job.chunks for p in c.parameters()):,}"
        f" params on this rank) for {cfg.trainer.max_steps} steps, "
        f"{job.derived.tokens_per_step:,} tokens/step, device {topo.device}"
    )
    trainer.stop = stop
    with stop or contextlib.nullcontext():
        try:
            history = trainer.fit()
        except TooManySkippedSteps:
            if trainer.saver is not None:
                trainer.saver.wait()  # a save started before the fault (every rank stops here)
            raise
        if trainer.saver is not None:
            trainer.saver.wait()
            done = trainer.saver.last_published or ""
            final = ckpt.save_final and not done.endswith(f"{trainer.state.step:07d}") and history
            if final and trainer.state.skipped_in_a_row:  # the state may be poisoned
                logger.info(f"not saving step {trainer.state.step}: the last "
                            f"{trainer.state.skipped_in_a_row} step(s) were skipped")  # fmt: skip
            elif final:
                logger.info(f"saved checkpoint {trainer.saver.save(blocking=True)}")
    logger.close()
    return history


def main_with_config(cfg) -> int:
    """Validate, dry-run or train; returns the process exit code. Never raises for user errors."""
    launch = detect_launch()
    prefix = f"[rank {launch.rank}] " if launch.world_size > 1 else ""
    world = launch.world_size
    if cfg.world_size is not None and cfg.trainer.dry_run:
        world = cfg.world_size
    errors = config_errors(cfg, world)
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
    if cfg.trainer.dry_run:
        if launch.rank == 0:
            print(dry_run_report(cfg, world), flush=True)
        return 0
    try:
        stop = StopRequest.from_config(cfg.trainer)  # the exit_after_minutes clock starts here
        run(cfg, stop)
    except ConfigError as e:
        print(f"{prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except (PeerError, FileNotFoundError, CheckpointError) as e:
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return EXIT_DATA
    except TooManySkippedSteps as e:
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except CollectiveError as e:
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return EXIT_COMM
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if stop.reason is not None:
        if launch.rank == 0:
            print(f"stopped early ({stop.reason}), exit code {EXIT_STOPPED}", flush=True)
        return EXIT_STOPPED
    return 0


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base=None)
def _hydra_main(cfg) -> None:
    OmegaConf.resolve(cfg)
    code = main_with_config(cfg)
    if code:
        sys.exit(code)


def _raised_inside(error: BaseException, fn) -> bool:
    """Whether ``fn`` is on ``error``'s traceback (a failure of the run, not of composing)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is fn.__code__:
            return True
        tb = tb.tb_next
    return False


def main() -> None:
    """Compose with Hydra and run; a composition error is one line on stderr and exit 2."""
    register_configs()
    show_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors here instead of printing
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as e:
        if show_traceback or _raised_inside(e, main_with_config):
            raise
        launch = detect_launch()
        prefix = f"[rank {launch.rank}] " if launch.world_size > 1 else ""
        reason = composition_error_reason(e)
        print(f"{prefix}invalid config: {reason}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    finally:
        if not show_traceback:
            os.environ.pop("HYDRA_FULL_ERROR", None)


if __name__ == "__main__":
    main()
