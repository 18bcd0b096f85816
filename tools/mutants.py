"""Plant deliberate bugs one at a time and check that the tests catch each (``make mutants``).

Each mutant is a small, realistic mistake (an edit of one or two lines) and the tests that
should catch it. The repository's files are copied once to a scratch directory; each mutant is
applied there, its tests run (``pytest -x``, the copy first on the import path), and the file
is restored. A mutant is CAUGHT only when a named test fails by an assertion (``assert``,
``torch.testing.assert_close``, ``pytest.raises``; a rank's, which ``run_world`` re-raises as
one); a test that fails by another exception (a NameError, an IndexError, a collection error, a
timeout) did not judge the bug, it CRASHED. The table says which test failed first and how, or
SURVIVED. The exit code is 1 if any mutant crashed, survived or no longer applies (its source
line changed: update the mutant).

Examples:
    python tools/mutants.py                 # every mutant (--list): about 31 min on 2 busy cores
    python tools/mutants.py --only moe-stats-tp-copies --logs /tmp/mutant-logs
    python tools/mutants.py --only loss-scale rng-restore
    python tools/mutants.py --list
    python tools/mutants.py --check         # edits apply, named tests exist; no test runs (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    # (text, its replacement): each text occurs once, verbatim or re-laid-out by the formatter
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]  # pytest node ids or files, run in order with -x


REF = "tests/training/test_reference_parity.py"
BLEND = "tests/data/test_data_blend.py"
GATHER = "tests/data_parallel/test_zero_gather.py"
GENERATE = "tests/generate/test_generate.py"
MOE = "tests/moe/test_moe.py"
SYNCS = "tests/training/test_host_syncs.py"
ZB_PARITY = "tests/pipeline/test_zero_bubble_parity.py"
PACKED_MODEL = "tests/model/test_packed_documents.py"
PACKED_TRAINING = "tests/training/test_packed_documents_training.py"
BALANCING = "tests/moe/test_moe_balancing.py"
MOE_CKPT = "tests/checkpoint/test_moe_checkpoint.py"
MOE_ZERO_RESUME = "tests/checkpoint/test_moe_zero_resume.py"
FP8 = "tests/tensor_parallel/test_fp8.py"
RUN_IDENTITY = "tests/checkpoint/test_run_identity.py"
VALIDATION = "tests/config/test_config_validation.py"
BAD_CONFIG = "tests/config/test_bad_config_matrix.py"
# a damaged RNG or compression file of a step (the files read whole) stops the resume
RANK_FILE_DAMAGE = (
    "tests/checkpoint/test_faults_checkpoint.py::"
    "test_a_damaged_rng_or_compression_file_stops_the_resume_naming_it"
)
# four 100-step runs of 2 ranks (marked slow): megatronish's PowerSGD against torch's hook
POWERSGD_AS_TORCH = (
    "tests/data_parallel/test_powersgd_reference.py::"
    "test_powersgd_costs_what_torchs_powersgd_hook_costs"
)
MUTANTS = [
    Mutant(
        "tp-all-reduce",
        "row-parallel output not summed over tp (a dropped all-reduce)",
        "megatronish/tensor_parallel/mappings.py",
        (("        return all_reduce(x.clone(), group)", "        return x.clone()"),),
        ("tests/tensor_parallel/test_tp_layers.py::test_row_parallel_linear_matches_linear",),
    ),
    Mutant(
        "tied-embedding-reduce",
        "tied embedding / head grads not summed across pp stages",
        "megatronish/data_parallel/zero.py",
        (
            (
                "        flat_all_reduce(sum_local_tied_copies(tied), self.topo.embedding_group)",
                "        pass",
            ),
        ),
        ("tests/pipeline/test_pp_parity.py::test_pipeline_matches_serial",),
    ),
    Mutant(
        "grad-norm-all-reduce",
        "grad norm's squares not summed across ranks",
        "megatronish/data_parallel/grad_norm.py",
        (("            all_reduce(sq, group)\n", "            pass\n"),),
        ("tests/tensor_parallel/test_tp_parity.py::test_tp_sp_matches_serial",),
    ),
    Mutant(
        "grad-norm-replicas",
        "tp-replicated params (norms) counted once per tp rank in the norm",
        "megatronish/data_parallel/zero.py",
        (("lambda n, p: counts_in_norm(n, p, self.topo)", "lambda n, p: True"),),
        ("tests/tensor_parallel/test_tp_parity.py::test_tp_sp_matches_serial",),
    ),
    Mutant(
        "1f1b-warmup",
        "1F1B warm-up one forward too many",
        "megatronish/pipeline/schedule.py",
        (
            (
                "return min(pp - rank - 1, num_microbatches)",
                "return min(pp - rank, num_microbatches)",
            ),
        ),
        ("tests/pipeline/test_pipeline_schedule.py",),
    ),
    Mutant(
        "loss-scale",
        "microbatch losses not scaled by 1/num_microbatches",
        "megatronish/training/trainer.py",
        (
            (
                "self.chunks, batches, loss_scale=1.0 / len(batches), param_hooks",
                "self.chunks, batches, loss_scale=1.0, param_hooks",
            ),
        ),
        (REF,),
    ),
    Mutant(
        "zero2-accumulate",
        "ZeRO-2 shard overwritten by each microbatch instead of summed",
        "megatronish/data_parallel/zero.py",
        (("accumulate=rounds > 0,", "accumulate=False,"),),
        ("tests/data_parallel/test_zero.py::test_zero_dp_matches_serial",),
    ),
    Mutant(
        "unsharded-adam",
        "Adam moments sized for whole buckets under ZeRO",
        "megatronish/training/trainer.py",
        (
            (
                "[shard.numel() for shard, _, _ in self.zero.optimizer_shards()]",
                "[b.numel for b in self.zero.buckets]",
            ),
        ),
        ("tests/data_parallel/test_zero_accounting.py::test_state_bytes_follow_the_zero_formulas",),
    ),
    Mutant(
        "decay-on-norms",
        "weight decay applied to norm weights",
        "megatronish/data_parallel/zero.py",
        (("lambda n, p: param_info(p).weight_decay", "lambda n, p: True"),),
        (REF,),
    ),
    Mutant(
        "warmup-off-by-one",
        "LR warm-up starts at 0 instead of lr/warmup",
        "megatronish/optim/lr_schedule.py",
        (("return lr * (step + 1) / warmup", "return lr * step / warmup"),),
        (REF,),
    ),
    Mutant(
        "clip-always",
        "grads scaled to max_norm even when the norm is below it",
        "megatronish/training/trainer.py",
        (("(max_norm / (norm + 1e-6)).clamp(max=1.0)", "(max_norm / (norm + 1e-6))"),),
        (REF,),
    ),
    Mutant(
        "rng-restore",
        "RNG streams not restored on resume",
        "megatronish/checkpoint/load.py",
        (
            (
                "    if _same_layout(meta, topo, vpp):\n        saved = read_rank_file(",
                "    if False:\n        saved = read_rank_file(",
            ),
        ),
        (
            "tests/checkpoint/test_resume_dropout.py::test_same_layout_resume_with_dropout_is_bit_identical",
        ),
    ),
    Mutant(
        "rank-file-crc-unchecked",
        "the RNG and compression files' CRC32s not checked on load",
        "megatronish/checkpoint/rank_files.py",
        (
            (
                "record is not None and verify and (problems := crc_problems(path, record, "
                "tensors))",
                "False and (problems := crc_problems(path, record, tensors))",
            ),
        ),
        (RANK_FILE_DAMAGE,),
    ),
    Mutant(
        "rank-file-size-unchecked",
        "a truncated RNG or compression file not caught by its size",
        "megatronish/checkpoint/rank_files.py",
        (
            (
                "record is not None and (problem := size_problem(path, record)) is not None",
                "False and (problem := size_problem(path, record)) is not None",
            ),
        ),
        (RANK_FILE_DAMAGE,),
    ),
    Mutant(
        "rank-files-not-recorded",
        "the save records no file's size or CRC32s",
        "megatronish/checkpoint/save.py",
        (("        files[names[kind]] = file_record(path, group, described)", "        pass"),),
        (RANK_FILE_DAMAGE,),
    ),
    Mutant(
        "info-skips-rank-files",
        "checkpoint_info --verify skips the RNG and compression files' CRC32s",
        "tools/checkpoint_info.py",
        (
            (
                "            problems += crc_problems(file, record, load_whole(path))",
                "            pass",
            ),
        ),
        (RANK_FILE_DAMAGE,),
    ),
    Mutant(
        "grad-reduction-may-change",
        "the grad compression or reduce dtype allowed to change on resume",
        "megatronish/checkpoint/run_identity.py",
        (
            (
                "    return _covered(key, ALWAYS_ALLOWED) and not _covered(key, CHANGES_THE_RUN)",
                "    return _covered(key, ALWAYS_ALLOWED)",
            ),
        ),
        (f"{RUN_IDENTITY}::test_how_the_gradient_is_reduced_is_part_of_the_run",),
    ),
    Mutant(
        "allow-changes-typo-accepted",
        "an allow_changes entry that names no key accepted",
        "megatronish/checkpoint/run_identity.py",
        (("        raise ConfigChanged(unknown)", "        pass"),),
        (f"{RUN_IDENTITY}::test_an_allow_changes_entry_that_names_no_key_is_refused",),
    ),
    Mutant(
        "decay-refusal-suggests-allow",
        "the refusal to train longer suggests allow_changes for decay_steps",
        "megatronish/checkpoint/run_identity.py",
        (
            (
                '    keys = ",".join(k for k, _, _ in changes if k != DECAY)',
                '    keys = ",".join(k for k, _, _ in changes)',
            ),
        ),
        (
            f"{RUN_IDENTITY}::"
            "test_raising_max_steps_is_another_run_unless_the_schedule_stays_the_same",
        ),
    ),
    Mutant(
        "compile-cache-is-a-change",
        "a changed compile_cache_dir refused on resume",
        "megatronish/checkpoint/run_identity.py",
        (('    "trainer.compile_cache_dir",\n', ""),),
        (f"{RUN_IDENTITY}::test_compiling_is_not_a_change_of_the_run",),
    ),
    Mutant(
        "adam-step-restore",
        "Adam's step count (bias correction) not restored on resume",
        "megatronish/checkpoint/load.py",
        (('opt.step_count = int(meta.trainer.get("optimizer_steps", 0))', "opt.step_count = 0"),),
        ("tests/checkpoint/test_checkpoint.py::test_exact_resume_single_process_is_bit_identical",),
    ),
    Mutant(
        "sampler-restore",
        "consumed samples not restored: a resumed run rereads its data",
        "megatronish/checkpoint/load.py",
        (
            (
                "parts.progress.consumed_samples = meta.consumed_samples",
                "parts.progress.consumed_samples = 0",
            ),
        ),
        ("tests/checkpoint/test_checkpoint.py::test_exact_resume_single_process_is_bit_identical",),
    ),
    Mutant(
        "export-rope-theta",
        "HF export writes the default rope_theta",
        "megatronish/hf/to_hf.py",
        (
            (
                'reads rope_parameters.\n        "rope_theta": spec.rope_theta,',
                'reads rope_parameters.\n        "rope_theta": 10000.0,',
            ),
            ('"rope_theta": spec.rope_theta}', '"rope_theta": 10000.0}'),
        ),
        ("tests/hf/test_hf_export.py::test_export_matches_transformers_and_imports_back",),
    ),
    Mutant(
        "model-rope-theta",
        "the model's rotary tables ignore rope_theta",
        "megatronish/model/gpt.py",
        (("self.spec.head_dim, self.spec.rope_theta, device", "self.spec.head_dim, 1e4, device"),),
        ("tests/hf/test_hf_export.py::test_export_matches_transformers_and_imports_back",),
    ),
    Mutant(
        "precision-ignored",
        "trainer.precision=bf16 ignored: params and compute stay fp32",
        "megatronish/training/trainer.py",
        (("self.param_dtype = DTYPES[cfg.trainer.precision]", "self.param_dtype = torch.float32"),),
        (
            "tests/model/test_bf16.py::test_every_matmul_and_attention_kernel_runs_in_the_configured_precision",
        ),
    ),
    Mutant(
        "sp-norm-grad-sum",
        "sequence-parallel norm grads not summed over tp",
        "megatronish/data_parallel/buckets.py",
        (("return info.sequence_parallel or info.replicated_heads or tied", "return tied"),),
        ("tests/tensor_parallel/test_tp_parity.py::test_tp_sp_matches_serial",),
    ),
    Mutant(
        "dp-same-samples",
        "every dp rank reads the same samples",
        "megatronish/training/trainer.py",
        (("start = first_sample + topo.coords.dp * per_rank", "start = first_sample"),),
        ("tests/training/test_training.py::test_data_parallel_matches_one_process",),
    ),
    Mutant(
        "grads-not-zeroed",
        "grads of the last step not zeroed before the next",
        "megatronish/data_parallel/zero.py",
        (("                b.grad_flat.zero_()\n", "                pass\n"),),
        (REF,),
    ),
    Mutant(
        "recompute-rng",
        "recomputed forward draws new dropout masks",
        "megatronish/model/recompute.py",
        (("        rng.load_state_dict(snapshot)\n", "        pass\n"),),
        ("tests/model/test_recompute.py",),
    ),
    Mutant(
        "eval-in-train-mode",
        "validation runs with dropout on",
        "megatronish/training/trainer.py",
        (
            (
                "        for c in self.chunks:\n            c.eval()",
                "        for c in self.chunks:\n            c.train()",
            ),
        ),
        (
            "tests/training/test_training.py::test_evaluation_runs_without_dropout_and_leaves_training_on",
        ),
    ),
    Mutant(
        "gpt2-gelu-exact",
        "gpt2's MLP uses the exact GELU instead of GPT-2's tanh approximation",
        "megatronish/model/blocks.py",
        (('y = F.gelu(y, approximate="tanh")', "y = F.gelu(y)"),),
        (REF,),
    ),
    Mutant(
        "dp-loss-mean",
        "reported loss summed over dp ranks, not averaged",
        "megatronish/training/trainer.py",
        (("return mean / self.topo.dp_cp", "return mean"),),
        ("tests/training/test_training.py::test_data_parallel_matches_one_process",),
    ),
    Mutant(
        "cp-grad-group",
        "grads averaged over dp only, not over dp x cp",
        "megatronish/data_parallel/zero.py",
        (("dp = topo.zero_shard_group", "dp = topo.dp_group"),),
        ("tests/context_parallel/test_context_parallel.py::test_cp_matches_serial",),
    ),
    Mutant(
        "cp-rope-positions",
        "RoPE tables not indexed by the cp rank's positions",
        "megatronish/model/gpt.py",
        (("cos, sin = cos[pos], sin[pos]", "cos, sin = cos[: pos.numel()], sin[: pos.numel()]"),),
        ("tests/context_parallel/test_context_parallel.py::test_cp_matches_serial",),
    ),
    Mutant(
        "blend-order",
        "blending error measured at g + 1 instead of Megatron's max(g, 1)",
        "megatronish/data/blend.py",
        (("t = g if g > 1 else 1", "t = g + 1"),),
        ("tests/data/test_data_blend.py",),
    ),
    Mutant(
        "prefetch-next",
        "the prefetcher reads the wrong next batch",
        "megatronish/training/prefetch.py",
        (
            (
                "self._pool.submit(self.read, first + self.stride)",
                "self._pool.submit(self.read, first + 1)",
            ),
        ),
        ("tests/data/test_prefetch.py",),
    ),
    Mutant(
        "expert-grad-group",
        "expert grads reduced over dp x cp (other ranks' experts) instead of edp",
        "megatronish/data_parallel/zero.py",
        (("b.group = edp if b.expert else dp", "b.group = dp"),),
        ("tests/moe/test_moe.py::test_expert_parallel_matches_one_process",),
    ),
    Mutant(
        "moe-aux-cp-scale",
        "cp ranks' parts of the balancing loss not scaled for the mean over cp",
        "megatronish/moe/layer.py",
        (("(self.loss_scale * cp.size)", "self.loss_scale"),),
        ("tests/moe/test_moe.py::test_expert_parallel_matches_one_process[ep4-cp2-dp2]",),
    ),
    Mutant(
        "moe-aux-loss-scale",
        "balancing and z losses not scaled like the microbatch's loss",
        "megatronish/moe/layer.py",
        (("(self.loss_scale * cp.size)", "cp.size"),),
        ("tests/moe/test_moe.py::test_balancing_and_z_losses_are_in_the_gradient",),
    ),
    Mutant(
        "moe-combine-order",
        "expert outputs sent back in expert order, not regrouped by source",
        "megatronish/moe/dispatch.py",
        (("outputs.index_select(0, back)", "outputs.index_select(0, record.regroup)"),),
        (
            "tests/moe/test_moe.py::test_dispatch_delivers_every_token_to_its_expert_and_combine"
            "_restores_order",
        ),
    ),
    Mutant(
        "valid-blend-train-split",
        "the validation blend reads the training split of each data.blend dataset",
        "megatronish/data/build.py",
        (
            (
                'datasets("blend", "valid", valid_fraction)',
                'datasets("blend", "train", valid_fraction)',
            ),
        ),
        (f"{BLEND}::test_validation_reads_the_valid_split_or_the_whole_blend_valid_datasets",),
    ),
    Mutant(
        "valid-blend-weights",
        "the validation blend of data.blend_valid drawn with the training weights",
        "megatronish/data/build.py",
        (("BlendedDataset(valid_parts, valid_weights,", "BlendedDataset(valid_parts, weights,"),),
        (f"{BLEND}::test_validation_reads_the_valid_split_or_the_whole_blend_valid_datasets",),
    ),
    Mutant(
        "zero3-no-backward-prefetch",
        "ZeRO-3 backward does not prefetch the next unit (gathered on demand instead)",
        "megatronish/data_parallel/param_gather.py",
        (("self.start_gather(visits[i - 1].unit)", "pass"),),
        (f"{GATHER}::test_zero3_backward_prefetches_the_next_unit_while_the_current_one_runs",),
    ),
    Mutant(
        "zero3-prefetch-wrong-unit",
        "ZeRO-3 backward prefetches two units ahead (wrapping to the head at the first block)",
        "megatronish/data_parallel/param_gather.py",
        (("self.start_gather(visits[i - 1].unit)", "self.start_gather(visits[i - 2].unit)"),),
        (f"{GATHER}::test_zero3_backward_prefetches_the_next_unit_while_the_current_one_runs",),
    ),
    Mutant(
        "zero3-tied-unit-not-the-loss",
        "ZeRO 3 counts only a unit of the head alone as the loss's: gpt2's tied embedding and head"
        " are freed after the forward and gathered again for the backward",
        "megatronish/data_parallel/param_units.py",
        (
            (
                "unit.holds_loss = head is not None and any(m is head for m in unit.modules)",
                "unit.holds_loss = head is not None and unit.modules == [head]",
            ),
        ),
        (f"{GATHER}::test_zero3_holds_what_the_planner_says",),
    ),
    Mutant(
        "generate-padded-logits",
        "generation draws from the padded vocabulary's logits",
        "megatronish/generate/decode.py",
        (
            (
                "logits = model.decode(ids, cache)[:, -1, :vocab]",
                "logits = model.decode(ids, cache)[:, -1]",
            ),
        ),
        (f"{GENERATE}::test_padded_and_unused_vocabulary_ids_are_never_generated",),
    ),
    Mutant(
        "generate-vocab-size-ignored",
        "generate ignores the tokenizer's vocab_size (ids it has no piece for can win)",
        "megatronish/generate/decode.py",
        (("vocab = vocab_size or model.spec.vocab_size", "vocab = model.spec.vocab_size"),),
        (f"{GENERATE}::test_padded_and_unused_vocabulary_ids_are_never_generated",),
    ),
    Mutant(
        "expert-piece-offset",
        "checkpoint pieces of experts written at the local index (offset 0 on every ep rank)",
        "megatronish/checkpoint/pieces.py",
        (
            (
                "        offsets[0][0] = first\n        offsets[shard.dim]",
                "        offsets[0][0] = 0\n        offsets[shard.dim]",
            ),
        ),
        (
            "tests/checkpoint/test_moe_checkpoint.py::test_experts_are_keyed_by_global_index",
            f"{MOE_ZERO_RESUME}::test_the_checkpoint_holds_the_saved_state_at_global_experts",
        ),
    ),
    Mutant(
        "piece-fused-block",
        "checkpoint pieces of a fused param (gate|up) all cut from its first block",
        "megatronish/checkpoint/pieces.py",
        (
            (
                "Rect(offsets, shard.dim, local, n, first, copy)",
                "Rect(offsets, shard.dim, 0, n, first, copy)",
            ),
        ),
        ("tests/checkpoint/test_moe_checkpoint.py::test_experts_are_keyed_by_global_index",),
    ),
    Mutant(
        "expert-cut-local-rows",
        "a ZeRO range that cuts an expert stack reads its pieces at local expert rows (an ep rank"
        " past the first loads another rank's experts into its slots)",
        "megatronish/checkpoint/pieces.py",
        (("offsets[0][0] += self.first", "offsets[0][0] += 0"),),
        (
            f"{MOE_ZERO_RESUME}::"
            "test_same_layout_resume_restores_every_expert_and_continues_bit_identically",
        ),
    ),
    Mutant(
        "moe-stats-tp-copies",
        "routing statistics reuse the balancing loss's counts (every tp rank's tokens) on each",
        "megatronish/moe/layer.py",
        (
            (
                "mine = count_per_expert(experts, moe.num_experts)",
                "mine = counts",
            ),
        ),
        (f"{MOE}::test_routing_metrics_under_tp_and_sp_equal_one_process",),
    ),
    Mutant(
        "moe-drops-every-tp-rank",
        "dropped slots counted on every tp rank",
        "megatronish/moe/layer.py",
        (("dropped if tp.group.rank == 0 else None", "dropped"),),
        (f"{MOE}::test_routing_metrics_under_tp_and_sp_equal_one_process",),
    ),
    Mutant(
        "moe-metrics-per-rank-mean",
        "routing losses averaged over every rank (tp and pp too), not over dp replicas",
        "megatronish/training/trainer.py",
        (
            (
                "self.topo.dp, self.derived.num_microbatches, self.topo.device,",
                "self.topo.world_size, self.derived.num_microbatches, self.topo.device,",
            ),
        ),
        (f"{MOE}::test_routing_metrics_under_tp_and_sp_equal_one_process",),
    ),
    Mutant(
        "grouped-mm-strided-grad",
        "grouped matmul's backward given an expanded (stride-0) incoming gradient",
        "megatronish/moe/grouped_mm.py",
        (
            ("        grad = contiguous_aligned(grad)", "        pass"),  # split backward's
            ("        out.register_hook(contiguous_aligned)", "        pass"),  # torch's
        ),
        (
            "tests/moe/test_moe_experts.py::"
            "test_an_expanded_output_grad_reaches_the_grouped_matmuls_laid_out",
            "tests/moe/test_moe_experts.py::test_experts_equal_a_per_expert_loop",
            "tests/moe/test_moe_split_backward.py::test_grouped_mm_grads_are_torchs_autograd_bitwise",
        ),
    ),
    Mutant(
        "head-padding-in-softmax",
        "the head's padded vocabulary columns reach the softmax",
        "megatronish/model/linear_cross_entropy.py",
        (('        logits[:, vocab_size:] = float("-inf")', "        pass"),),
        (
            "tests/model/test_linear_cross_entropy.py::"
            "test_logits_use_the_padded_width_and_padding_never_reaches_the_softmax",
        ),
    ),
    Mutant(
        "fp32-gqa-math-kernel",
        "fp32 grouped-query attention on CUDA left to SDPA's math kernel (K/V not expanded)",
        "megatronish/context_parallel/attention_kernel.py",
        (
            (
                '        return AttentionKernel("efficient", expand_kv=gqa)',
                '        return AttentionKernel("efficient", expand_kv=False)',
            ),
        ),
        ("tests/model/test_attention_kernel.py",),
    ),
    Mutant(
        "async-writer-reads-early",
        "the checkpoint writer reads host buffers before their device copies completed",
        "megatronish/checkpoint/save.py",
        (("                shot.copied.wait()\n", "                pass\n"),),
        ("tests/checkpoint/test_async_save_streams.py",),
    ),
    Mutant(
        "zero3-built-whole",
        "ZeRO 3 builds every rank's whole chunk before sharding it",
        "megatronish/training/job.py",
        (("deferred=ZERO_STAGES[cfg.parallel.zero_stage].shards_params,", "deferred=False,"),),
        (
            "tests/data_parallel/test_sharded_build.py::test_zero3_build_holds_at_most_one_unit_beyond_its_shards",
        ),
    ),
    Mutant(
        "head-grad-bf16-product",
        "the bf16 head's weight-grad product rounded to bf16 before its fp32 sum",
        "megatronish/model/linear_cross_entropy.py",
        (("    return torch.mm(a.float(), b.float())", "    return torch.mm(a, b).float()"),),
        ("tests/model/test_head_main_grad.py",),
    ),
    Mutant(
        "blend-cache-crc",
        "the blend index cache is read without checking its CRC32",
        "megatronish/data/blend.py",
        (
            (
                "            if file_crc32(path) != crcs[os.path.basename(path)]:",
                "            if False:",
            ),
        ),
        (
            "tests/tools/test_tool_inputs_data.py::test_blend_cache_with_an_edited_in_range_entry_is_rebuilt",
        ),
    ),
    Mutant(
        "repeated-override",
        "a key given twice on the command line silently keeps the last",
        "megatronish/config/cli_errors.py",
        (("        if len(given) > 1:", "        if len(given) > 2:"),),
        ("tests/tools/test_tool_inputs_cli.py",),
    ),
    Mutant(
        "latest-not-a-step",
        "a `latest` that holds no step name is followed",
        "megatronish/checkpoint/format.py",
        (("    if step_of(name) is None:\n", "    if not name:\n"),),
        ("tests/tools/test_tool_inputs_checkpoint.py",),
    ),
    Mutant(
        "skip-decided-on-host",
        "the skip of a non-finite step decided on the host (a device read every step)",
        "megatronish/training/trainer.py",
        (
            (
                "found_inf = (~torch.isfinite(norm)).float()",
                "found_inf = norm.new_zeros(()) if bool(norm.isfinite()) else norm.new_ones(())",
            ),
        ),
        (f"{SYNCS}::test_a_dense_step_reads_the_device_at_most_once[dp2-zero1]",),
    ),
    Mutant(
        "moe-bincount",
        "experts counted with bincount (a device read per count on CUDA)",
        "megatronish/moe/routing.py",
        (
            (
                "    ids = torch.arange(num_experts, device=experts.device)\n",
                "    return torch.bincount(experts.reshape(-1), minlength=num_experts)\n",
            ),
        ),
        (f"{SYNCS}::test_a_moe_step_reads_the_device_once_per_block_forward[ep2]",),
    ),
    Mutant(
        "cp-index-per-call",
        "context parallelism copies its chunk index to the device in every layer",
        "megatronish/context_parallel/attention.py",
        (
            (
                "chunks.index_select(0, chunk_index(tuple(order), x.device))",
                "chunks.index_select(0, torch.tensor(order, device=x.device))",
            ),
        ),
        (f"{SYNCS}::test_a_dense_step_reads_the_device_at_most_once[cp2]",),
    ),
    Mutant(
        "preprocess-non-string",
        "a non-string text value is tokenized",
        "megatronish/data/preprocess.py",
        (("        if not isinstance(text, str):", "        if text is None:"),),
        ("tests/tools/test_tool_inputs_data.py",),
    ),
    Mutant(
        "zbv-tied-local-sum",
        "zbv: the embedding and its head copy, both on stage 0, not summed there",
        "megatronish/data_parallel/grads.py",
        (("        original.main_grad.add_(copy.main_grad)\n", ""),),
        (f"{ZB_PARITY}::test_zero_bubble_matches_one_process[zbv-gpt2-tied]",),
    ),
    Mutant(
        "zb-h1-no-held-w",
        "ZB-H1 runs every W right after its B (no W held back to fill the cool-down)",
        "megatronish/pipeline/zero_bubble.py",
        (("        if k >= rank:", "        if k >= 0:"),),
        (
            "tests/pipeline/test_zero_bubble_schedule.py::test_zb_h1_bubble_is_the_papers_and_below_1f1b",
        ),
    ),
    Mutant(
        "b-computes-w",
        "the engine's B does not defer the weight grads (W has nothing to do)",
        "megatronish/pipeline/engine.py",
        (
            (
                'deferred = op.kind == "bwd_input" and op.chunk > 0',
                "deferred = False",
            ),
        ),
        (f"{ZB_PARITY}::test_zero_reduces_a_bucket_when_its_last_w_is_done",),
    ),
    Mutant(
        "zero-counts-absent-grads",
        "ZeRO counts a parameter whose grad B left to W as arrived",
        "megatronish/data_parallel/grad_hooks.py",
        (('        if not getattr(p, "grad_arrived", True):', "        if False:"),),
        (f"{ZB_PARITY}::test_zero_bubble_matches_one_process[zbv-dp2-zero1]",),
    ),
    Mutant(
        "main-grad-bf16-sum",
        "bf16 microbatch grads summed into the main grad in bf16",
        "megatronish/data_parallel/grad_hooks.py",
        (
            (
                "            p.main_grad.add_(grad)\n            p.grad = None",
                "            p.main_grad.copy_(p.main_grad.to(grad.dtype) + grad)\n"
                "            p.grad = None",
            ),
        ),
        (
            "tests/data_parallel/test_main_grad_accumulation.py::"
            "test_bf16_grads_of_the_microbatches_are_summed_in_fp32[0]",
        ),
    ),
    Mutant(
        "zb-w-after-wait",
        "a zero-bubble W runs after its step's group is waited for, not while it is in flight",
        "megatronish/pipeline/engine.py",
        (
            (  # the W loop before the waits runs nothing
                "            weight(op.microbatch, op.chunk)\n        op = step.compute",
                "            pass\n        op = step.compute",
            ),
            (
                "            completed, quiet = completed + 1, False\n",
                "            completed, quiet = completed + 1, False\n"
                "        for w in step.weights:\n            weight(w.microbatch, w.chunk)\n",
            ),
        ),
        (
            "tests/pipeline/test_zero_bubble_schedule.py::"
            "test_each_w_runs_while_its_steps_group_is_in_flight",
        ),
    ),
    Mutant(
        "document-positions-run-on",
        "reset_position_ids keeps counting across documents",
        "megatronish/data/documents.py",
        (
            (
                "positions = torch.from_numpy(np.arange(s + 1) - starts)[:, :s]",
                "positions = torch.from_numpy(np.arange(s + 1) + 0 * starts)[:, :s]",
            ),
        ),
        (f"{PACKED_MODEL}::test_every_document_gets_the_logits_and_losses_it_gets_alone",),
    ),
    Mutant(
        "document-positions-one-based",
        "reset_position_ids counts each document's positions from 1",
        "megatronish/data/documents.py",
        (
            (
                "positions = torch.from_numpy(np.arange(s + 1) - starts)[:, :s]",
                "positions = torch.from_numpy(np.arange(1, s + 2) - starts)[:, :s]",
            ),
        ),
        # the model's test fails too, but by indexing past the RoPE table (an IndexError)
        ("tests/data/test_documents.py::test_microbatch_layout_is_megatrons",),
    ),
    Mutant(
        "document-mask-sees-other-documents",
        "the document mask is only causal: queries see earlier documents",
        "megatronish/context_parallel/document_attention.py",
        (
            (
                "visible = (query_ids[:, :, None] == key_ids[:, None, :]) & (",
                "visible = (query_ids[:, :, None] >= key_ids[:, None, :]) & (",
            ),
        ),
        (f"{PACKED_MODEL}::test_every_document_gets_the_logits_and_losses_it_gets_alone",),
    ),
    Mutant(
        "cp-document-keys-local",
        "under cp a chunk's keys are matched against the query chunk's own documents",
        "megatronish/context_parallel/document_attention.py",
        (
            (
                "return document_mask(ids[:, j * c : keys], ids[:, :keys], rows, dtype)",
                "return document_mask(ids[:, j * c : keys], ids[:, :keys].flip(1), rows, dtype)",
            ),
        ),
        (f"{PACKED_MODEL}::test_each_cp_rank_attends_to_exactly_its_documents_keys",),
    ),
    Mutant(
        "segments-batch-unequal-samples",
        "the CPU path batches neighbouring samples whatever their segments",
        "megatronish/context_parallel/document_attention.py",
        (
            (
                "while end < len(segments) and segments[end] == segments[row]:",
                "while end < len(segments):",
            ),
        ),
        (f"{PACKED_MODEL}::test_segments_of_whole_documents_attend_like_each_document_alone",),
    ),
    Mutant(
        "eod-loss-own-tokens",
        "eod_mask_loss divides each microbatch by the wrong share of the kept tokens",
        "megatronish/data/documents.py",
        (
            (
                "    return max(kept, 1) / (dp_cp * microbatches)",
                "    return max(kept, 1) / (dp_cp * microbatches * microbatches)",
            ),
        ),
        (f"{PACKED_TRAINING}::test_eod_mask_loss_is_the_mean_over_the_global_batchs_kept_tokens",),
    ),
    Mutant(
        "eod-loss-count-own-batch",
        "every rank counts kept tokens of its own samples only",
        "megatronish/training/trainer.py",
        (
            (
                "            s, end = self.spec.seq_length, first_sample + t.global_batch_size",
                "            s, end = self.spec.seq_length, start + per_rank",
            ),
            (
                "            whole = [samples[i][1] for i in range(first_sample, end)]",
                "            whole = [samples[i][1] for i in range(start, end)] * topo.dp",
            ),
        ),
        (f"{PACKED_TRAINING}::test_packed_documents_train_like_one_process[dp2-zero3]",),
    ),
    Mutant(
        "document-flops-window",
        "MFU counts the window's s^2 attention under document masks",
        "megatronish/training/trainer.py",
        (("        spec = replace(self.spec, attended_keys=span)", "        spec = self.spec"),),
        (f"{PACKED_TRAINING}::test_step_flops_count_each_documents_squared_length",),
    ),
    Mutant(
        "expert-bias-local-loads",
        "each rank moves its expert biases by its own tokens' loads, not the global batch's",
        "megatronish/moe/balancing.py",
        (("    return all_reduce(rows, world)", "    return rows"),),
        (f"{BALANCING}::test_balanced_sigmoid_group_routing_matches_one_process[ep2-tp2-sp]",),
    ),
    Mutant(
        "expert-bias-weighs",
        "the expert bias enters the experts' weights, not only their choice",
        "megatronish/moe/routing.py",
        (
            (
                "    weights = scores.gather(-1, experts)",
                "    weights = (scores if bias is None else scores + bias).gather(-1, experts)",
            ),
        ),
        (f"{BALANCING}::test_the_expert_bias_picks_experts_and_weighs_nothing",),
    ),
    Mutant(
        "expert-bias-sign",
        "the bias moves away from balance (the load minus the mean)",
        "megatronish/moe/balancing.py",
        (
            (
                "        offset = torch.sign(load.mean() - load).to(torch.float32)",
                "        offset = torch.sign(load - load.mean()).to(torch.float32)",
            ),
        ),
        (f"{BALANCING}::test_the_expert_bias_balances_the_load_without_the_balancing_loss",),
    ),
    Mutant(
        "expert-bias-not-saved",
        "a checkpoint leaves the model's buffers out: a resume routes with zero biases",
        "megatronish/checkpoint/snapshot.py",
        (("    for name, buf in parts.buffers.items():", "    for name, buf in {}.items():"),),
        (f"{MOE_CKPT}::test_same_layout_resume_with_expert_biases_is_bit_identical",),
    ),
    Mutant(
        "ep-first-no-tp-sum",
        "Megatron's order returns each tp rank's partial expert outputs without summing over tp",
        "megatronish/moe/dispatch.py",
        (
            (
                "        return reduce_scatter_uneven(x.clone(), group, sizes)",
                "        return x.split(sizes)[group.rank].clone()",
            ),
        ),
        (f"{MOE}::test_expert_parallel_matches_one_process[ep2-tp2-sp-ep-first]",),
    ),
    Mutant(
        "ep-first-own-rows-only",
        "Megatron's order gathers each tp rank's received rows with its own count for every rank",
        "megatronish/moe/dispatch.py",
        (
            (
                "    tp_sizes = [sum(got[r * num_experts : (r + 1) * num_experts]) for r in "
                "range(tp.size)]",
                "    tp_sizes = [sum(mine)] * tp.size",
            ),
        ),
        (
            f"{MOE}::test_ep_first_dispatch_gathers_every_tp_ranks_rows_and_combine_sums_them_back",
            f"{MOE}::test_expert_parallel_matches_one_process[ep2-tp2-sp-ep-first]",
        ),
    ),
    Mutant(
        "ep-first-plan-keeps-mlp-collectives",
        "the planner still counts a dense MLP's sequence-parallel collectives in Megatron's order",
        "megatronish/plan/moe.py",
        (
            (
                "    not_gathered = 2 * blocks.moe + blocks.redo  # the dense MLP's input gathers",
                "    not_gathered = 0",
            ),
        ),
        ("tests/plan/test_plan_moe.py::test_planned_moe_communication_matches_commstats",),
    ),
    Mutant(
        "shared-overlap-waits-first",
        "the rows' all-to-all is waited before the shared experts run: nothing overlaps",
        "megatronish/moe/dispatch.py",
        (
            (
                "    result = during()\n    pending[0].wait()\n",
                "    pending[0].wait()\n    result = during()\n",
            ),
        ),
        ("tests/moe/test_moe_overlap.py::test_the_shared_experts_run_while_the_tokens_travel",),
    ),
    Mutant(
        "group-score-top1",
        "a group is scored by its best expert alone, not its top_k / max_groups best",
        "megatronish/moe/routing.py",
        (
            (
                "    group_scores = best_in_group[..., : top_k // max_groups].sum(dim=-1)",
                "    group_scores = best_in_group[..., 0]",
            ),
        ),
        (f"{BALANCING}::test_group_limited_routing_keeps_each_token_in_its_best_groups",),
    ),
    Mutant(
        "qk-norm-grads-not-summed",
        "per-head query/key norm weights' grads left partial on each tp rank without sp",
        "megatronish/model/blocks.py",
        (
            (
                "        partial = tp.size > 1 if per_head else tp.sequence_parallel",
                "        partial = False if per_head else tp.sequence_parallel",
            ),
        ),
        ("tests/tensor_parallel/test_tp_parity.py::test_qk_norm_and_head_dim_match_serial",),
    ),
    Mutant(
        "qwen3-experts-gate-up-swapped",
        "Qwen3-MoE experts' gate and up projections written to each other's names",
        "megatronish/hf/qwen3.py",
        (
            (
                'QWEN3_EXPERTS = ExpertNames("mlp.", "gate_proj.weight", "up_proj.weight", '
                '"down_proj.weight")',
                'QWEN3_EXPERTS = ExpertNames("mlp.", "up_proj.weight", "gate_proj.weight", '
                '"down_proj.weight")',
            ),
        ),
        ("tests/hf/test_hf_qwen3.py::test_export_matches_transformers",),
    ),
    Mutant(
        "shared-overlap-credits-the-longer",
        "the planner credits the longer of the rows exchange and the shared experts' forward",
        "megatronish/plan/moe.py",
        (
            (
                "    return forwards * min(exchange, shared)",
                "    return forwards * max(exchange, shared)",
            ),
        ),
        (
            "tests/plan/test_plan_moe.py::"
            "test_the_shared_experts_hide_part_of_each_forward_exchange",
        ),
    ),
    Mutant(
        "a2a-sequence-out-of-order",
        "the heads' all-to-all leaves the received chunks in rank order, not sequence order",
        "megatronish/context_parallel/head_exchange.py",
        (
            (
                "    return reorder_chunks(whole, natural_order(cp))",
                "    return whole",
            ),
        ),
        (
            "tests/context_parallel/test_context_parallel.py::"
            "test_the_exchange_gives_each_rank_the_whole_sequence_of_its_heads",
            "tests/context_parallel/test_context_parallel.py::test_all_to_all_cp_matches_serial",
        ),
    ),
    Mutant(
        "a2a-plan-forgets-backward",
        "the planner counts the heads' exchanges of forward only",
        "megatronish/plan/context_parallel.py",
        (
            (
                "        calls = 2 * forwards + 2 * m * n_layers",
                "        calls = 2 * forwards",
            ),
        ),
        ("tests/plan/test_plan.py::test_planned_communication_matches_measured",),
    ),
    Mutant(
        "planner-cache-ignores-the-cp-exchange",
        "the planner's cached blocks are shared by layouts of either cp exchange",
        "megatronish/plan/layout.py",
        (
            (
                "            self.cp_comm_type,\n            self.cp_a2a_size,",
                "            self.cp_a2a_size,",
            ),
        ),
        ("tests/plan/test_advisor.py::test_one_planner_tells_layouts_of_the_same_shape_apart",),
    ),
    Mutant(
        "kv-replica-grads",
        "replicated kv heads' partial grads not summed over their copies",
        "megatronish/data_parallel/grads.py",
        (
            (
                "        if not param_info(p).replicated_heads:\n            continue\n"
                "        shard =",
                "        if True:\n            continue\n        shard =",
            ),
        ),
        (
            "tests/tensor_parallel/test_replicated_kv_heads.py::test_the_copies_of_a_kv_head_stay_identical",
        ),
    ),
    Mutant(
        "kv-replica-norm",
        "every copy of a replicated kv head counted in the grad norm",
        "megatronish/data_parallel/grads.py",
        (
            (
                "        return first_copy_elements(p, topo.coords.tp, topo.tp)",
                "        return True",
            ),
        ),
        (
            "tests/tensor_parallel/test_replicated_kv_heads.py::test_replicated_kv_heads_match_one_process",
        ),
    ),
    Mutant(
        "kv-replica-saved-twice",
        "every copy of a replicated kv head written to the checkpoint",
        "megatronish/checkpoint/snapshot.py",
        (("if not rect.first_copy:", "if False:"),),
        (
            "tests/tensor_parallel/test_replicated_kv_heads.py::test_a_tp4_checkpoint_of_gqa2_stores_each_kv_head_once_and_reshards_both_ways",
        ),
    ),
    Mutant(
        "kv-replica-placement",
        "kv heads replicated round-robin, away from the query heads that read them",
        "megatronish/tensor_parallel/sharding.py",
        (
            (
                "        return rank * self.parts(block, tp) // tp",
                "        return rank % self.parts(block, tp)",
            ),
        ),
        (
            "tests/tensor_parallel/test_replicated_kv_heads.py::test_a_block_of_fewer_heads_than_ranks_is_replicated_on_consecutive_ranks",
            "tests/tensor_parallel/test_replicated_kv_heads.py::test_replicated_kv_heads_match_one_process",
        ),
    ),
    Mutant(
        "kv-replica-plan-volume",
        "the planner forgets the replicated kv biases in the tp grad sum",
        "megatronish/plan/dense.py",
        (("(spec.hidden_size + int(spec.bias))", "spec.hidden_size"),),
        ("tests/plan/test_plan.py::test_planned_communication_matches_measured",),
    ),
    Mutant(
        "ring-dkv-owner",
        "ring attention names its dK/dV receive after the block it held the step before",
        "megatronish/context_parallel/ring.py",
        (
            (
                '        out.append(("recv", prev, ("dkv", step, ring_owner(rank, step, cp))))',
                '        out.append(("recv", prev, ("dkv", step, ring_owner(rank, step - 1, cp))))',
            ),
        ),
        (
            "tests/context_parallel/test_ring_attention.py::test_the_ring_posts_never_deadlock_under_nccl_order",
        ),
    ),
    Mutant(
        "ring-block-part",
        "ring attention: an earlier rank's block seen by the second query chunk only",
        "megatronish/context_parallel/ring.py",
        (
            (
                "    return FIRST_KEYS if owner < rank else SECOND_QUERIES",
                "    return FIRST_KEYS if owner > rank else SECOND_QUERIES",
            ),
        ),
        (
            "tests/context_parallel/test_ring_attention.py::test_every_visible_chunk_pair_is_attended_once",
        ),
    ),
    Mutant(
        "ring-merge-weights",
        "ring attention adds block outputs without their log-sum-exp weights",
        "megatronish/context_parallel/ring_kernel.py",
        (
            (
                "    out = out * torch.exp(lse - merged).unsqueeze(-1) + new_out * torch.exp(",
                "    out = out + new_out * 0 * torch.exp(",
            ),
        ),
        (
            "tests/context_parallel/test_ring_attention.py::test_merged_blocks_and_their_backward_equal_attention_over_all_keys",
        ),
    ),
    Mutant(
        "ring-dkv-dropped",
        "ring attention keeps its own share of dK/dV and drops the accumulator it receives",
        "megatronish/context_parallel/ring.py",
        (
            (
                '            acc = dkv if step == 0 else got["dkv"].add_(dkv)',
                "            acc = dkv",
            ),
        ),
        (
            "tests/context_parallel/test_ring_attention.py::test_ring_attention_trains_like_one_process",
        ),
    ),
    Mutant(
        "ring-plan-overlap",
        "the planner hides the ring's sends behind the longer of the send and the block",
        "megatronish/plan/context_parallel.py",
        (("* (cp - 1) * min(send, forward_block)", "* (cp - 1) * max(send, forward_block)"),),
        ("tests/plan/test_plan.py::test_the_ring_hides_its_sends_behind_its_blocks_and_no_more",),
    ),
    Mutant(
        "a2a-ring-rings-the-a2a-group",
        "a2a_ring passes K/V around its all-to-all group instead of the ring across the groups",
        "megatronish/context_parallel/attention.py",
        (("group=self.ring_group,", "group=self.a2a_group,"),),
        ("tests/context_parallel/test_a2a_ring.py::test_a2a_ring_trains_like_one_process",),
    ),
    Mutant(
        "a2a-ring-grid-order",
        "a2a_ring's rings are cut from consecutive cp ranks and its all-to-all groups strided",
        "megatronish/distributed/parallel_grid.py",
        (('CP_ORDER = "tp-cp_a2a-cp_ring-dp-pp"', 'CP_ORDER = "tp-cp_ring-cp_a2a-dp-pp"'),),
        (
            "tests/distributed/test_parallel_grid.py::test_a2a_ring_cuts_each_cp_group_into_a2a_groups_and_rings",
        ),
    ),
    Mutant(
        "a2a-ring-plan-ring-size",
        "the planner runs a2a_ring's ring over the whole cp group",
        "megatronish/plan/context_parallel.py",
        (("return layout.cp // layout.cp_a2a_size", "return layout.cp"),),
        ("tests/plan/test_plan.py::test_planned_communication_matches_measured",),
    ),
    Mutant(
        "hybrid-norm-counts-replicas",
        "hybrid sharding counts every replica's shard in the grad norm",
        "megatronish/data_parallel/zero.py",
        (
            (
                "b.norm_ranges = []  # hybrid sharding: the first replica of the shard counts",
                "pass  # hybrid sharding: the first replica of the shard counts",
            ),
        ),
        (
            "tests/data_parallel/test_hybrid_shard.py::test_shard_groups_of_two_on_four_dp_ranks_match_one_process",
        ),
    ),
    Mutant(
        "hybrid-every-replica-writes",
        "every hybrid-sharding replica writes its shard to the checkpoint",
        "megatronish/checkpoint/pieces.py",
        (("bucket.replicas is not None and bucket.replicas.rank != 0", "False"),),
        ("tests/checkpoint/test_checkpoint.py::test_format_each_shard_once_with_checksums",),
    ),
    Mutant(
        "hybrid-replica-reduce-at-step-end",
        "hybrid sharding all-reduces every shard over the replicas only when the step ends",
        "megatronish/data_parallel/zero.py",
        (("self._replica_reducer(b) if hybrid", "None if hybrid"),),
        (
            "tests/data_parallel/test_hybrid_shard.py::test_each_shard_is_all_reduced_over_the_replicas_during_the_last_backward",
        ),
    ),
    Mutant(
        "hybrid-bf16-replica-sum-dropped",
        "hybrid sharding's bf16 all-reduce over the replicas not copied back into the shard",
        "megatronish/data_parallel/grad_reduce.py",
        (("            self.shard.copy_(self.wire)", "            pass"),),
        (
            "tests/data_parallel/test_hybrid_shard.py::"
            "test_bf16_reduced_shards_hold_the_sum_over_every_replica",
        ),
    ),
    Mutant(
        "hybrid-plan-replica-whole-buckets",
        "the planner all-reduces whole buckets over the replicas, not the shards",
        "megatronish/plan/data_parallel.py",
        (("sum(b.numel // b.dp for b in dense_flat)", "sum(b.numel for b in dense_flat)"),),
        ("tests/plan/test_plan.py::test_planned_communication_matches_measured",),
    ),
    Mutant(
        "hybrid-grid-order",
        "hybrid sharding's shard groups are strided and its replicas consecutive",
        "megatronish/distributed/parallel_grid.py",
        (
            (
                'ZERO_ORDER = "tp-cp-dp_shard-dp_replica-pp"',
                'ZERO_ORDER = "tp-cp-dp_replica-dp_shard-pp"',
            ),
        ),
        (
            "tests/distributed/test_parallel_grid.py::test_hybrid_sharding_cuts_each_dp_cp_group_into_shard_groups_and_replicas",
        ),
    ),
    Mutant(
        "int8-no-error-feedback",
        "int8 compression forgets what its rounding lost",
        "megatronish/data_parallel/int8_reduce.py",
        (("error.view(members, shard).copy_(x - dequantize(q, scales))", "error.zero_()"),),
        (
            "tests/data_parallel/test_grad_compression.py::test_error_feedback_keeps_the_sum_of_what_was_sent_next_to_the_sum_of_the_grads",
        ),
    ),
    Mutant(
        "int8-scale-per-shard",
        "int8 compression scales each shard by its absmax instead of each block",
        "megatronish/data_parallel/int8_reduce.py",
        (
            (
                "    scales = padded.abs().amax(-1) / 127.0",
                "    scales = padded.abs().amax((1, 2), keepdim=True).squeeze(-1).repeat(1, blocks)"
                " / 127.0",
            ),
        ),
        (
            "tests/data_parallel/test_int8_codec.py::"
            "test_every_block_is_reconstructed_within_half_a_step_of_its_own_absmax",
        ),
    ),
    Mutant(
        "powersgd-no-error-feedback",
        "PowerSGD forgets what its low rank lost",
        "megatronish/data_parallel/powersgd.py",
        (("self.state.errors[i].copy_(m - total / members)", "self.state.errors[i].zero_()"),),
        (
            "tests/data_parallel/test_grad_compression.py::test_error_feedback_keeps_the_sum_of_what_was_sent_next_to_the_sum_of_the_grads",
            POWERSGD_AS_TORCH,
        ),
    ),
    Mutant(
        "powersgd-no-warm-start",
        "PowerSGD starts every step's power iteration from the seeded Q, not the last step's",
        "megatronish/data_parallel/powersgd.py",
        (("            self.state.qs[i].copy_(q)\n", "            pass\n"),),
        (
            "tests/data_parallel/test_powersgd_warm_start.py::test_each_step_starts_its_power_iteration_from_the_last_steps_q",
            POWERSGD_AS_TORCH,
        ),
    ),
    Mutant(
        "powersgd-matrices-overlap",
        "every PowerSGD matrix views the start of its bucket",
        "megatronish/data_parallel/powersgd.py",
        (("out.append(Matrix(offset, *nm))", "out.append(Matrix(0, *nm))"),),
        (POWERSGD_AS_TORCH,),
    ),
    Mutant(
        "powersgd-result-to-a-copy",
        "PowerSGD compresses and writes a copy of each matrix: the bucket keeps the local grads",
        "megatronish/data_parallel/powersgd.py",
        (
            (
                "full[a.offset : a.offset + a.n * a.m].view(a.n, a.m)",
                "full[a.offset : a.offset + a.n * a.m].view(a.n, a.m).clone()",
            ),
        ),
        (POWERSGD_AS_TORCH,),
    ),
    Mutant(
        "powersgd-error-after-result",
        "PowerSGD's error feedback computed after the result overwrote the grads",
        "megatronish/data_parallel/powersgd.py",
        (
            (
                "            self.state.errors[i].copy_(m - total / members)\n"
                "            m.copy_(total)\n",
                "            m.copy_(total)\n"
                "            self.state.errors[i].copy_(m - total / members)\n",
            ),
        ),
        (POWERSGD_AS_TORCH,),
    ),
    Mutant(
        "compression-state-not-restored",
        "a resume keeps the error feedback it started with instead of the checkpoint's",
        "megatronish/checkpoint/load.py",
        (
            (
                "    if zero.compressor is not None:\n        _restore",
                "    if False:\n        _restore",
            ),
        ),
        (
            "tests/data_parallel/test_grad_compression.py::test_resume_on_the_same_layout_is_bit_identical",
        ),
    ),
    Mutant(
        "plan-int8-without-scales",
        "the planner sends int8 shards without their scales",
        "megatronish/plan/grad_compression.py",
        (("r * b.dp * packed_bytes(b.numel // b.dp)", "r * b.numel"),),
        ("tests/plan/test_plan.py::test_planned_communication_matches_measured",),
    ),
    Mutant(
        "plan-powersgd-one-call",
        "the planner counts one all-reduce per PowerSGD bucket, not two",
        "megatronish/plan/grad_compression.py",
        (("calls += rounds_b * (1 + bool(mats))", "calls += rounds_b"),),
        ("tests/plan/test_plan.py::test_planned_communication_matches_measured",),
    ),
    Mutant(
        "offload-params-not-awaited",
        "offloaded params are used before their copy up is waited for",
        "megatronish/data_parallel/offload.py",
        (
            (
                "self.transfers.device_waits(self.up_events.pop(id(b)))",
                "self.up_events.pop(id(b))",
            ),
        ),
        (
            "tests/data_parallel/test_optimizer_offload.py::test_the_host_update_equals_the_device_update_bit_for_bit",
        ),
    ),
    Mutant(
        "offload-grads-not-awaited",
        "the host updates before the grads' copies down are waited for",
        "megatronish/data_parallel/zero.py",
        (("self.offload.transfers.host_waits()", "pass"),),
        (
            "tests/data_parallel/test_optimizer_offload.py::test_the_host_update_equals_the_device_update_bit_for_bit",
        ),
    ),
    Mutant(
        "offload-copy-before-average",
        "a bucket's grads are copied down before they are averaged over dp",
        "megatronish/data_parallel/zero.py",
        (
            (
                "        grad.mul_(self.grad_scale)\n        if self.offload is not None:\n"
                "            self.offload.grads_down(b, grad)",
                "        if self.offload is not None:\n"
                "            self.offload.grads_down(b, grad)\n        grad.mul_(self.grad_scale)",
            ),
        ),
        (
            "tests/data_parallel/test_optimizer_offload.py::test_the_host_update_equals_the_device_update_bit_for_bit",
        ),
    ),
    Mutant(
        "offload-up-backward-order",
        "offloaded params copied up in backward order (the first forward waits for every copy)",
        "megatronish/data_parallel/zero.py",
        (
            (
                "for b in [b for bs in self.buckets_of for b in reversed(bs)]:  # forward order\n"
                "                self.offload.params_up(b)",
                "for b in self.buckets:\n                self.offload.params_up(b)",
            ),
        ),
        (
            "tests/data_parallel/test_optimizer_offload.py::"
            "test_params_go_up_in_the_order_the_next_forward_uses_them",
        ),
    ),
    Mutant(
        "plan-offload-keeps-moments",
        "the planner keeps the Adam moments on the device under offload",
        "megatronish/plan/data_parallel.py",
        (
            (
                "host, optimizer = offload_pinned_bytes(owned, model) + optimizer, 0",
                "host = offload_pinned_bytes(owned, model) + optimizer",
            ),
        ),
        (
            "tests/data_parallel/test_optimizer_offload.py::test_the_planner_moves_the_optimizer_state_to_the_host_as_the_runtime_does",
        ),
    ),
    Mutant(
        "compression-without-warm-up",
        "grad compression starts at the first step whatever grad_compression_start_step says",
        "megatronish/data_parallel/zero.py",
        (
            (
                "self.reducer.compressing = step >= self.compression_start_step",
                "self.reducer.compressing = True",
            ),
        ),
        (
            "tests/data_parallel/test_grad_compression.py::test_compressed_training_tracks_the_uncompressed_run",
        ),
    ),
    Mutant(
        "powersgd-compresses-vocab",
        "PowerSGD compresses the word embedding and output layer without being asked",
        "megatronish/data_parallel/powersgd.py",
        (("if param_info(p).vocab and not compress_vocab:", "if False:"),),
        (
            "tests/data_parallel/test_grad_compression.py::test_powersgd_leaves_the_vocabulary_matrices_uncompressed_unless_asked",
        ),
    ),
    Mutant(
        "compile-traces-collectives",
        "torch.compile traces a collective of more than one rank into its graph",
        "megatronish/distributed/comm.py",
        (("return eager(*args, **kwargs)", "return fn(*args, **kwargs)"),),
        ("tests/model/test_compile.py::test_a_collective_of_more_than_one_rank_is_not_traced",),
    ),
    Mutant(
        "compile-falls-back-silently",
        "A block that cannot be compiled whole falls back without saying why",
        "megatronish/model/compile.py",
        (
            (
                'self.log(f"{self.name} and blocks like it compiled in pieces: {reason}")',
                "pass",
            ),
        ),
        (
            "tests/model/test_compile.py::test_a_block_that_cannot_be_captured_whole_falls_back_in_pieces_and_says_why_once",
        ),
    ),
    Mutant(
        "export-keeps-stale-files",
        "the HF export leaves generation_config.json or shards of an earlier model in its folder",
        "tools/export_hf.py",
        (("    for name in replaced_files(os.listdir(out_dir)):", "    for name in []:"),),
        (
            "tests/hf/test_hf_export.py::"
            "test_an_export_over_an_earlier_model_leaves_no_file_that_contradicts_it",
        ),
    ),
    Mutant(
        "fp8-left-operand-layout",
        "An fp8 GEMM's left operand reaches _scaled_mm in the layout inductor chose for it",
        "megatronish/tensor_parallel/fp8.py",
        (("a = a.contiguous()", "a = a"),),
        # Eager casts leave every left operand row-major; only inductor lays a quantized
        # transpose out column-major, and its lowering of _scaled_mm refuses that (InductorError,
        # on a GPU too): no check runs earlier, so this one stays CRASHED.
        (f"{FP8}::test_compiled_fp8_linears_equal_eager_ones",),
    ),
    Mutant(
        "fp8-linears-in-bf16",
        "trainer.fp8 marks the linears but the column-parallel ones still run in bf16",
        "megatronish/tensor_parallel/layers.py",
        (
            (
                "        if self.fp8 is not None:\n            return fp8_linear(",
                "        if False:\n            return fp8_linear(",
            ),
        ),
        (f"{FP8}::test_the_blocks_linears_run_in_fp8_and_the_first_and_last_blocks_can_stay_bf16",),
    ),
    Mutant(
        "fp8-plan-without-copies",
        "The planner counts a tensorwise fp8 MLP's inputs at bf16 size",
        "megatronish/plan/dense.py",
        (("return -x.s * x.b * (x.h + x.f) * (e - 1)", "return 0"),),
        (f"{FP8}::test_the_planner_counts_what_tensorwise_fp8_keeps",),
    ),
    Mutant(
        "fp8-experts-in-bf16",
        "trainer.fp8 marks the experts but they run their GEMMs in bf16",
        "megatronish/moe/experts.py",
        (("if fp8 and rows.shape[0]:", "if False:"),),
        (f"{FP8}::test_the_experts_run_their_three_gemms_in_fp8",),
    ),
    Mutant(
        "fp8-rowwise-grads-e5m2",
        "rowwise fp8 casts the output grad to e5m2 (not torchao's rowwise recipe)",
        "megatronish/tensor_parallel/fp8.py",
        (
            (
                "g8, sg = quantize(g, E4M3, -1, power_of_2=True)",
                "g8, sg = quantize(g, E5M2, -1, power_of_2=True)",
            ),
        ),
        (f"{FP8}::test_the_recipes_are_torchaos",),
    ),
    Mutant(
        "fp8-rowwise-exact-scales",
        "rowwise fp8 scales the forward input exactly instead of by a power of two",
        "megatronish/tensor_parallel/fp8.py",
        (
            (
                "x8, sx = quantize(x2, E4M3, -1 if rowwise else None, power_of_2=rowwise)",
                "x8, sx = quantize(x2, E4M3, -1 if rowwise else None)",
            ),
        ),
        (f"{FP8}::test_the_recipes_are_torchaos",),
    ),
    Mutant(
        "fp8-expert-stack-row-major",
        "The experts' input-grad GEMM gets the fp8 weight stack row-major (CUDA refuses it)",
        "megatronish/moe/fp8_grouped.py",
        (("w8 = _column_major_stack(w8)", "w8 = w8"),),
        (
            f"{FP8}::test_the_experts_run_their_three_gemms_in_fp8",
            f"{FP8}::test_each_expert_gemm_equals_the_product_of_its_dequantized_operands",
        ),
    ),
    Mutant(
        "collectives-import-the-compiler",
        "The collectives are marked for torch.compile with torch.compiler.disable at import",
        "megatronish/distributed/comm.py",
        (("eager = _disable_dynamo(fn)", "eager = torch.compiler.disable(fn)"),),
        ("tests/model/test_precision_switches.py::test_the_default_mode_costs_no_compiler_import",),
    ),
    Mutant(
        "fp8-expert-groups-unpadded",
        "The experts' fp8 weight grad sums groups of any size (CUDA's kernel asserts on them)",
        "megatronish/moe/fp8_grouped.py",
        (
            (
                "up = (size + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS",
                "up = size",
            ),
        ),
        (
            "tests/moe/test_fp8_expert_groups.py::"
            "test_each_experts_rows_are_padded_to_whole_blocks_of_16_rows_with_zeros",
            f"{FP8}::test_each_expert_gemm_equals_the_product_of_its_dequantized_operands",
        ),
    ),
    Mutant(
        "compiled-attention-asks-in-graph",
        "Under torch.compile the K/V layout is asked of torch's checks inside the traced graph",
        "megatronish/context_parallel/attention_kernel.py",
        (("if gqa and torch.compiler.is_compiling():", "if False:"),),
        (
            "tests/model/test_attention_kernel.py::"
            "test_a_compiled_block_of_grouped_query_attention_is_captured_whole",
            "tests/model/test_attention_kernel.py::test_compiled_attention_is_one_graph_with_the_checks_asked_while_tracing",
        ),
    ),
    Mutant(
        "pipeline-waits-for-every-group",
        "The engine waits for every posted group before each compute, ignoring Step.ready",
        "megatronish/pipeline/engine.py",
        (
            (
                "need = completed + len(in_flight) if step.ready is None else step.ready",
                "need = completed + len(in_flight)",
            ),
        ),
        (
            "tests/pipeline/test_pipeline_nccl_sim.py::test_the_engine_posts_and_waits_exactly_as_planned",
        ),
    ),
    Mutant(
        "early-receives-unwaited",
        "Interleaved 1F1B's computes wait for no group, their inputs' included",
        "megatronish/pipeline/grouping.py",
        (
            (
                "ready = max((holder[message(recv)] for recv in needed), default=0)",
                "ready = 0",
            ),
        ),
        (
            "tests/pipeline/test_pipeline_nccl_sim.py::test_interleaved_computes_wait_only_for_the_groups_holding_their_data",
        ),
    ),
    Mutant(
        "cp-a2a-size-at-cp1",
        "cp_a2a_size accepted at cp=1 (the grid raises a traceback later)",
        "megatronish/config/cp_rules.py",
        (("        if a2a_size is None:", "        if True:"),),
        (f"{VALIDATION}::test_each_rule_names_the_values",),
    ),
    Mutant(
        "boundary-outside-vocab",
        "a document boundary id outside the vocabulary is accepted (nothing is packed)",
        "megatronish/config/data_rules.py",
        (("    if int(boundary) < size:", "    if True:"),),
        (f"{VALIDATION}::test_document_boundaries_must_be_an_id_of_the_vocabulary",),
    ),
    Mutant(
        "router-unchecked-on-dense",
        "router values go unchecked on a dense model",
        "megatronish/config/moe_rules.py",
        (
            (
                "        return errors + router_errors(moe.router, 0, moe.top_k)",
                "        return errors",
            ),
        ),
        (f"{VALIDATION}::test_router_values_are_checked_on_a_dense_model_too",),
    ),
    Mutant(
        "num-groups-zero",
        "router num_groups=0 passes the >= 1 rule",
        "megatronish/config/moe_rules.py",
        (("        if groups < 1:", "        if groups < 0:"),),
        (f"{VALIDATION}::test_router_values_are_checked_on_a_dense_model_too",),
    ),
    Mutant(
        "compress-vocab-unchecked",
        "powersgd_compress_vocab accepted without PowerSGD",
        "megatronish/config/dp_rules.py",
        (('    if kind != "powersgd" and p.powersgd_compress_vocab:', "    if False:"),),
        (f"{VALIDATION}::test_each_rule_names_the_values",),
    ),
    Mutant(
        "powersgd-rank-unchecked",
        "a PowerSGD rank no matrix allows is accepted (nothing is compressed)",
        "megatronish/config/dp_rules.py",
        (("    if rank <= most:", "    if True:"),),
        (f"{VALIDATION}::test_the_powersgd_rank_rule_knows_the_matrices_the_trainer_compresses",),
    ),
    Mutant(
        "compile-cache-file",
        "a compile cache dir that is a file passes the start-up check",
        "megatronish/config/compile_rules.py",
        (("    if not os.path.isdir(node):", "    if False:"),),
        (f"{VALIDATION}::test_the_compile_cache_dir_is_tried_where_the_run_writes_it",),
    ),
    Mutant(
        "moe-notes-dropped",
        "settings that do nothing on a dense model are not noted",
        "megatronish/config/value_rules.py",
        (("    notes += moe_notes(cfg)\n", ""),),
        (f"{BAD_CONFIG}::test_dry_runs_and_the_planner_say_the_same_note",),
    ),
    Mutant(
        "planner-no-notes",
        "the planner prints none of the notes the trainer prints",
        "megatronish/plan/cli.py",
        (("    for note in config_notes(cfg):", "    for note in []:"),),
        (f"{BAD_CONFIG}::test_dry_runs_and_the_planner_say_the_same_note",),
    ),
    Mutant(
        "candidates-keep-start-step",
        "the advisor's candidates keep a compression start step without the compression",
        "megatronish/plan/candidates.py",
        (("    if layout.grad_compression is None:", "    if False:"),),
        (
            "tests/plan/test_advisor.py::test_the_configs_compression_keys_do_not_refuse_the_candidates",
        ),
    ),
    Mutant(
        "startup-stop-agreement",
        "a stop signal during start-up is not agreed before building",
        "megatronish/train.py",
        (
            (
                "        if stop is not None and _stop_before_training(stop, topo):",
                "        if False:",
            ),
        ),
        (
            "tests/training/test_operations_stop.py::test_a_stop_signal_during_start_up_stops_before_anything_is_built",
        ),
    ),
    Mutant(
        "startup-signal-handover",
        "a signal recorded while importing is dropped",
        "megatronish/training/stop.py",
        (
            (
                "            if self.received is None:\n                self.received = earlier",
                "            pass",
            ),
        ),
        (
            "tests/training/test_operations_stop.py::test_a_stop_signal_before_the_stop_request_exists_is_handed_over_to_it",
        ),
    ),
    Mutant(
        "startup-signals-installed",
        "no stop-signal handler while torch imports",
        "megatronish/train.py",
        (
            (
                '_STARTUP = StartupSignals.install() if __name__ == "__main__" else None',
                "_STARTUP = None",
            ),
        ),
        (
            "tests/training/test_ctrl_c.py::test_a_signal_while_torch_imports_aborts_or_stops_in_one_line",
        ),
    ),
    Mutant(
        "ctrl-c-during-import",
        "Ctrl-C while importing prints a traceback",
        "megatronish/train.py",
        (('with ctrl_c_aborts(enabled=__name__ == "__main__"):', "if True:"),),
        (
            "tests/training/test_ctrl_c.py::test_a_signal_while_torch_imports_aborts_or_stops_in_one_line",
        ),
    ),
    Mutant(
        "quiet-torchrun-signal",
        "torchrun's traceback after a stop signal",
        "scripts/lib/quiet_torchrun.py",
        (
            (
                "        return 1  # the agent logged the signal and stopped the workers; "
                "their codes follow",
                "        raise",
            ),
        ),
        (
            "tests/scripts/test_launchers.py::test_a_stop_signal_to_launch_local_reaches_real_torchruns_workers_and_their_code_returns",
        ),
    ),
    Mutant(
        "quiet-torchrun-graceful",
        "torchrun's failure summary after workers that stopped (4)",
        "scripts/lib/quiet_torchrun.py",
        (
            (
                "    return all(f.exitcode in GRACEFUL_CODES for f in error.failures.values())",
                "    return False",
            ),
        ),
        (
            "tests/scripts/test_launchers.py::test_launch_local_exits_with_the_trainers_code_not_torchruns",
        ),
    ),
    Mutant(
        "ring-dkv-bf16-hops",
        "ring attention rounds its dK/dV accumulator to bf16 at every hop",
        "megatronish/context_parallel/ring.py",
        (
            (
                '            acc = dkv if step == 0 else got["dkv"].add_(dkv)',
                '            acc = (dkv if step == 0 else got["dkv"].float() + dkv).to(kv.dtype)',
            ),
        ),
        (
            "tests/context_parallel/test_ring_blocks.py::test_the_ring_rounds_its_dk_dv_accumulators_once",
        ),
    ),
    Mutant(
        "ring-math-tile-causal-offset",
        "the math kernel's causal triangle ignores the tile's first row",
        "megatronish/context_parallel/ring_kernel.py",
        (
            (
                'scores.masked_fill_(hidden.triu_(1 + rows.start), float("-inf"))',
                'scores.masked_fill_(hidden.triu_(1), float("-inf"))',
            ),
        ),
        (
            "tests/context_parallel/test_ring_blocks.py::test_the_math_kernel_in_tiles_equals_it_in_one_piece_and_the_cpu_kernel",
        ),
    ),
    Mutant(
        "ring-flash-always-expands",
        "the CUDA flash block copies grouped K/V to the query heads",
        "megatronish/context_parallel/ring_kernel.py",
        (
            (
                "        heads, expand = q.shape[1], flash_expands_kv(q, k, v)",
                "        heads, expand = q.shape[1], True",
            ),
        ),
        (
            "tests/context_parallel/test_ring_blocks.py::test_the_cuda_flash_block_takes_grouped_kv_where_sdpas_rule_does",
        ),
    ),
    Mutant(
        "plan-ring-score-tiles-missing",
        "the planner forgets the math kernel's fp32 score tiles",
        "megatronish/plan/context_parallel.py",
        (
            (
                "2 * b * heads * rows * keys * 4",
                "0 * b * heads * rows * keys * 4",
            ),
        ),
        (
            "tests/plan/test_plan_ring_blocks.py::test_the_planned_ring_workspace_covers_the_measured_backward",
        ),
    ),
    Mutant(
        "plan-ring-kernel-ignores-documents",
        "the planner runs document-masked ring blocks on flash",
        "megatronish/plan/context_parallel.py",
        (
            (
                "dtype, spec.head_dim, layout.document_masks)",
                "dtype, spec.head_dim)",
            ),
        ),
        (
            "tests/plan/test_plan_ring_blocks.py::test_packed_documents_on_cuda_plan_the_math_kernels_score_tiles",
        ),
    ),
    Mutant(
        "fp8-cast-amax-in-fp32",
        "The fp8 cast takes its amax through an fp32 copy and abs",
        "megatronish/tensor_parallel/fp8.py",
        (
            (
                '        return torch.linalg.vector_norm(t, float("inf"))',
                "        return t.float().abs().amax()",
            ),
        ),
        (f"{FP8}::test_the_cast_moves_a_third_of_the_bytes",),
    ),
    Mutant(
        "fp8-tensorwise-quotient-in-bf16",
        "A 0-dim tensorwise scale leaves the quotient in bf16 (rounded twice)",
        "megatronish/tensor_parallel/fp8.py",
        (
            (
                "torch.div(t, scale.expand((1,) * t.dim()) if dim is None else scale)",
                "torch.div(t, scale)",
            ),
        ),
        (f"{FP8}::test_the_cast_gives_the_fp32_casts_bits",),
    ),
    Mutant(
        "fp8-expert-amax-misassigned",
        "The experts' segmented amax gives groups each other's blocks",
        "megatronish/moe/fp8_grouped.py",
        (('"max", lengths=self.blocks,', '"max", lengths=self.blocks.flip(0),'),),
        (f"{FP8}::test_the_experts_padded_cast_equals_the_scatter_and_reads_nothing_back",),
    ),
    Mutant(
        "fp8-forward-slow-accumulation",
        "The fp8 forward GEMM runs without fast accumulation",
        "megatronish/tensor_parallel/fp8.py",
        (('x.dtype, FAST_ACCUM["forward"])', "x.dtype)"),),
        (f"{FP8}::test_only_the_forward_gemm_accumulates_fast",),
    ),
    Mutant(
        "fp8-plan-expert-casts",
        "The planner counts a padded fp8 cast as its fp8 copy only",
        "megatronish/plan/moe.py",
        (("13 * padded_rows // 4", "padded_rows"),),
        (f"{FP8}::test_the_planner_counts_an_fp8_expert_backwards_temporaries",),
    ),
    Mutant(
        "pinned-rule-exact",
        "pinned blocks assumed unrounded (torch rounds each up to a power of two)",
        "megatronish/data_parallel/pinned_memory.py",
        (("return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()", "return max(nbytes, 0)"),),
        (
            "tests/data_parallel/test_offload_pinned.py::test_pinned_block_bytes_is_the_next_power_of_two",
        ),
    ),
    Mutant(
        "offload-host-bytes-unrounded",
        "the offload reports its pinned slabs unrounded",
        "megatronish/data_parallel/offload.py",
        (
            (
                "return sum(pinned_block_bytes(n) if self.pinned else n for n in sizes)",
                "return sum(sizes)",
            ),
        ),
        (
            "tests/data_parallel/test_offload_pinned.py::test_on_a_gpu_the_slabs_are_pinned_and_counted_as_torch_rounds_them",
        ),
    ),
    Mutant(
        "stop-check-blocking",
        "the step-boundary stop check blocks on a world all-reduce again",
        "megatronish/training/trainer.py",
        (
            (
                "reason = self.stop.agreed_late(self.topo.world_group)",
                "reason = self.stop.agreed(self.topo.world_group)",
            ),
        ),
        (
            "tests/training/test_stop_a_step_late.py::test_a_signal_on_one_rank_stops_every_rank_after_the_next_step_and_saves_it",
        ),
    ),
]


def copy_repo(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files (no .venv, caches or outputs)."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(root: Path, m: Mutant) -> str:
    """Edit ``m.file`` under ``root``; returns the original text."""
    path = root / m.file
    original = text = path.read_text()
    for old, new in m.edits:
        spans = anchor_spans(text, old)
        if len(spans) != 1:
            raise ValueError(f"{m.name}: {old!r} occurs {len(spans)} times in {m.file}")
        text = replace_anchor(text, spans[0], old, new)
    path.write_text(text)
    return original


def _anchor_pattern(old: str) -> re.Pattern[str]:
    """``old`` with its layout made free: any whitespace (line breaks and indentation included)
    between its characters, and the trailing comma a formatter adds before a closing bracket."""
    parts = []
    for c in old.strip():
        if c.isspace():
            continue
        parts.append((r",?\s*" if c in ")]}" else "") + re.escape(c))
    return re.compile(r"\s*".join(parts))


def anchor_spans(text: str, old: str) -> list[tuple[int, int]]:
    """Where ``old`` occurs in ``text``: verbatim if it does, else as the same characters laid
    out differently (a mutant's anchor survives ``ruff format`` re-wrapping its line)."""
    if old in text:
        starts = [m.start() for m in re.finditer(re.escape(old), text)]
        return [(i, i + len(old)) for i in starts]
    return [m.span() for m in _anchor_pattern(old).finditer(text)]


def replace_anchor(text: str, span: tuple[int, int], old: str, new: str) -> str:
    """``text`` with ``span`` (where ``old`` matched) replaced by ``new``. A verbatim match is
    replaced as it is; a re-laid-out one by ``new`` less the indentation and trailing whitespace
    ``old`` carries (the matched code keeps its own)."""
    start, end = span
    if text[start:end] == old:
        return text[:start] + new + text[end:]
    indent = len(old) - len(old.lstrip())
    core = new[indent:] if new[:indent].isspace() or not new[:indent] else new.lstrip()
    trail = len(old) - len(old.rstrip())
    if trail and core.endswith(old[len(old) - trail :]):
        core = core[: len(core) - trail]
    return text[:start] + core + text[end:]


# A pytest plugin (``-p``) writing how the first test to fail failed, as JSON, to the file named
# by $MUTANTS_VERDICT: ``check`` is true when it failed by a check (an AssertionError, which
# ``torch.testing.assert_close`` and ``pytest.raises(match=...)`` raise, or ``pytest.fail``, which
# ``pytest.raises`` calls when nothing was raised). A test world's failure
# (megatronish.testing.multiproc.WorldError, also as the ``__cause__`` of what the test raised)
# counts by what its first failed rank raised (``root_type``), not by its own type.
VERDICT_PLUGIN = """
import json
import os

import pytest

PATH = os.environ["MUTANTS_VERDICT"]


def _verdict(exc):
    world = exc
    while world is not None and not hasattr(world, "root_type"):
        world = world.__cause__
    if world is not None:
        return world.root_type or type(world).__name__, isinstance(world, AssertionError)
    return type(exc).__name__, isinstance(exc, (AssertionError, pytest.fail.Exception))


def _record(test, when, kind, check):
    if not os.path.exists(PATH):  # the first failure only
        with open(PATH, "w") as f:
            json.dump({"test": test, "when": when, "type": kind, "check": check}, f)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None:
        _record(item.nodeid, call.when, *_verdict(call.excinfo.value))
    return report


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid, "collect", "collection error", False)
"""


@dataclass(frozen=True)
class Outcome:
    """How a mutant's tests ended: ``CAUGHT`` (a named test failed by an assertion),
    ``CRASHED`` (it failed by another exception, a collection error or a timeout: the bug broke
    the code, no check judged it), ``SURVIVED`` (every test passed) or ``STALE``."""

    verdict: str
    test: str = ""  # the first failing test
    detail: str = ""  # CRASHED: what it raised; STALE: why the mutant did not apply
    seconds: float = 0.0

    def __str__(self) -> str:
        if self.verdict == "CRASHED":
            return f"CRASHED ({self.detail}) {self.test}".rstrip()
        if self.verdict == "STALE":
            return f"STALE: {self.detail}"
        return f"{self.verdict} {self.test}".rstrip()


def run_tests(
    root: Path, tests: tuple[str, ...], timeout: float, log: Path | None = None
) -> Outcome:
    """How pytest ``-x`` on ``tests`` in ``root`` ended (its output written to ``log``)."""
    with tempfile.TemporaryDirectory(prefix="megatronish-mutant-verdict-") as tmp:
        Path(tmp, "mutants_verdict.py").write_text(VERDICT_PLUGIN)
        verdict_path = Path(tmp, "verdict.json")
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(root), tmp]),
            WANDB_MODE="disabled",
            MUTANTS_VERDICT=str(verdict_path),
        )
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        cmd += ["-p", "mutants_verdict", *tests]
        start = time.monotonic()
        try:
            r = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            if log is not None:
                log.write_text(_text(e.stdout) + _text(e.stderr))
            seconds = time.monotonic() - start
            return Outcome("CRASHED", "", f"timed out after {timeout:.0f} s", seconds)
        seconds = time.monotonic() - start
        if log is not None:
            log.write_text(r.stdout + r.stderr)
        if r.returncode == 0:
            return Outcome("SURVIVED", seconds=seconds)
        if not verdict_path.is_file():
            return Outcome("CRASHED", "", f"pytest exit {r.returncode}", seconds)
        v = json.loads(verdict_path.read_text())
    if v["check"]:
        return Outcome("CAUGHT", v["test"], seconds=seconds)
    return Outcome("CRASHED", v["test"], v["type"], seconds)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def check_imports(root: Path) -> None:
    """The scratch copy, not the installed checkout, must be what the tests import."""
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run(
        [sys.executable, "-c", "import megatronish; print(megatronish.__file__)"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    if not out.stdout.strip().startswith(str(root)):
        raise SystemExit(f"the tests would import {out.stdout.strip()}, not the scratch copy")


def edit_problems(m: Mutant, root: Path = REPO) -> list[str]:
    """Why ``m``'s edits would not apply to the files under ``root`` (empty: they would)."""
    path = root / m.file
    if not path.is_file():
        return [f"{m.name}: {m.file} does not exist"]
    text, problems = path.read_text(), []
    for old, new in m.edits:
        if old == new:
            problems.append(f"{m.name}: the edit of {old!r} changes nothing")
        elif len(spans := anchor_spans(text, old)) != 1:
            problems.append(f"{m.name}: {old!r} occurs {len(spans)} times in {m.file}")
        else:
            text = replace_anchor(text, spans[0], old, new)
    return problems


def collected_ids(files: list[str]) -> tuple[set[str], list[str]]:
    """``(node ids pytest collects from files, its collection errors)`` (one pytest run)."""
    if not files:
        return set(), []
    env = dict(os.environ, WANDB_MODE="disabled")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-o",
        "addopts=",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        *files,
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    ids = {
        line.strip()
        for line in r.stdout.splitlines()
        if "::" in line and " " not in line.split("::", 1)[0]
    }
    errors = re.findall(r"^ERROR (\S+.*)$", r.stdout, flags=re.M)
    if r.returncode not in (0, 1) and not ids:
        errors.append(f"pytest --collect-only exit {r.returncode}: {r.stdout.strip()[-300:]}")
    return ids, errors


def test_id_found(test: str, ids: set[str]) -> bool:
    """Whether ``test`` (a file, a test function or one parametrized case) names collected
    tests."""
    if "::" not in test:
        return any(i.startswith(test + "::") for i in ids)
    return test in ids or any(i.startswith(test + "[") for i in ids)


def check(mutants: list[Mutant]) -> list[str]:
    """Every problem that would make a mutant STALE or name a missing test, one line each;
    no test runs (pytest only collects the named test files)."""
    problems = []
    names = [m.name for m in mutants]
    problems += [
        f"{n}: the name is used by {names.count(n)} mutants"
        for n in sorted(set(names))
        if names.count(n) > 1
    ]
    for m in mutants:
        problems += edit_problems(m)
        if not m.tests:
            problems.append(f"{m.name}: names no test")
    files = sorted({t.split("::")[0] for m in mutants for t in m.tests})
    missing = [f for f in files if not (REPO / f).is_file()]
    ids, errors = collected_ids([f for f in files if f not in missing])
    problems += [f"pytest could not collect: {e}" for e in errors]
    for m in mutants:
        for t in m.tests:
            if t.split("::")[0] in missing:
                problems.append(f"{m.name}: test file {t.split('::')[0]} does not exist")
            elif not test_id_found(t, ids):
                problems.append(f"{m.name}: test {t} is not collected")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check that every edit applies once and every named test "
        "exists (no test runs; for CI)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant")
    parser.add_argument(
        "--logs", type=Path, metavar="DIR", help="write each mutant's pytest output to DIR/NAME.log"
    )
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        unknown = set(args.only) - {m.name for m in MUTANTS}
        parser.error(f"unknown mutants {sorted(unknown)}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:37s} {m.what}  [{m.file}]")
        return 0
    if args.check:
        problems = check(chosen)
        for line in problems:
            print(line)
        if not problems:
            tests = len({t for m in chosen for t in m.tests})
            print(f"{len(chosen)} mutants: every edit applies once, all {tests} tests exist")
        return 1 if problems else 0
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="megatronish-mutants-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        check_imports(root)
        print(f"{len(chosen)} mutants, scratch copy {root}", flush=True)
        for m in chosen:
            log = None if args.logs is None else args.logs / f"{m.name}.log"
            try:
                original = apply(root, m)
            except ValueError as e:
                outcome = Outcome("STALE", detail=str(e))
            else:
                try:
                    outcome = run_tests(root, m.tests, args.timeout, log)
                finally:
                    (root / m.file).write_text(original)
            outcomes.append(outcome)
            print(f"{m.name:37s} {outcome.seconds:6.1f} s  {outcome}", flush=True)
    print("\n| mutant | bug | file | result | s |\n|---|---|---|---|---|")
    for m, o in zip(chosen, outcomes):
        print(f"| {m.name} | {m.what} | `{m.file}` | {o} | {o.seconds:.0f} |")
    print()
    print(summary(chosen, outcomes))
    return 0 if all(o.verdict == "CAUGHT" for o in outcomes) else 1


def summary(chosen: list[Mutant], outcomes: list[Outcome]) -> str:
    """The closing lines: how many an assertion caught, and every mutant it did not."""
    caught = sum(o.verdict == "CAUGHT" for o in outcomes)
    lines = [f"{caught} of {len(chosen)} caught by an assertion"]
    for verdict in ("CRASHED", "SURVIVED", "STALE"):
        names = [
            f"{m.name} ({o.detail})" if verdict == "CRASHED" else m.name
            for m, o in zip(chosen, outcomes)
            if o.verdict == verdict
        ]
        if names:
            lines.append(f"{len(names)} {verdict}: {', '.join(names)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
