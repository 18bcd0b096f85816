"""Generation from checkpoints: greedy parity with transformers, the KV cache, sampling, the CLI.

Tiny models are trained a few steps (so their logits are far from uniform) and saved, at tp=1
and by a 2-rank tp=2 world; each is generated from in one process. Every greedy token must be
the token ``transformers`` takes greedily on the Hugging Face export of the same checkpoint: its
argmax, or within round-off of it (two implementations sum in different orders, so a near tie
may break either way on some CPU).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatronish.generate.cli import main
from megatronish.generate.decode import generate, new_cache
from megatronish.generate.sampling import (
    Sampling,
    filtered_logits,
    next_token,
    top_k_filter,
    top_p_filter,
)
from megatronish.generate.session import load_model
from megatronish.testing.cli import load_tool
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import train_layout

REPO = Path(__file__).resolve().parents[2]
VOCAB = 250  # TINY_TEST_MODEL's real vocabulary
SEQ = ["model.seq_length=32"]
ARCHS = {"llama": [], "gpt2": ["model.arch=gpt2", "model.num_query_groups=8"]}
EOS = 2  # the id exports record when the run's tokenizer is unknown
_CACHE: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("generate")


def checkpoint(workdir: Path, arch: str, tp: int = 1) -> str:
    """A checkpoint of the tiny model after 10 training steps, saved by ``tp`` ranks."""
    key = (arch, tp)
    if key not in _CACHE:
        path = str(workdir / f"{arch}-tp{tp}")
        overrides = [*ARCHS[arch], *SEQ, f"parallel.tp={tp}"]
        if tp == 1:
            train_layout(0, 1, overrides, 10, None, path)
        else:
            run_world(train_layout, tp, overrides, 10, None, path, timeout=300)
        _CACHE[key] = path
    return _CACHE[key]


def prompts() -> torch.Tensor:
    return torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(11))


def export(ckpt: str, out: str) -> str:
    load_tool("export_hf").export(ckpt, out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp"), [("llama", 1), ("gpt2", 1), ("llama", 2)])
def test_greedy_tokens_equal_transformers_generate(workdir, arch, tp):
    from transformers import AutoModelForCausalLM

    ckpt = checkpoint(workdir, arch, tp)
    ours = generate(load_model(ckpt).model, prompts(), 27, eos_id=EOS).ids
    hf_dir = export(ckpt, str(workdir / f"hf-{arch}-tp{tp}"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' logits along our continuation
        logits = hf(ours, attention_mask=torch.ones_like(ours)).logits[:, 4:-1, :VOCAB]
    chosen = logits.gather(-1, ours[:, 5:, None]).squeeze(-1)
    top2 = logits.topk(2, dim=-1).values
    after_eos = (ours[:, 5:] == EOS).long().cumsum(dim=1) - (ours[:, 5:] == EOS).long() > 0
    short = (top2[..., 0] - chosen).masked_fill(after_eos, 0)  # 0 where ours is HF's argmax
    print(
        f"{arch} tp={tp}: rows {ours.tolist()}, largest shortfall {short.max():.1e}, "
        f"closest top-2 gap {(top2[..., 0] - top2[..., 1]).min():.1e}"
    )
    assert short.max() < 1e-4, short
    assert len(set(ours[:, 5:].flatten().tolist())) > 3  # a real continuation, not one token


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_logits_equal_a_full_forward(workdir, arch):
    model = load_model(checkpoint(workdir, arch)).model
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.head.logits(model(ids)).transpose(0, 1)
        cache = new_cache(model, 2, 32)
        parts = [model.decode(ids[:, :5], cache), model.decode(ids[:, 5:9], cache)]  # prompt, chunk
        parts += [model.decode(ids[:, i : i + 1], cache) for i in range(9, 32)]  # one at a time
    gap = (torch.cat(parts, dim=1) - full).abs().max().item()
    print(f"{arch}: max |cached - full| logit = {gap:.2e}")
    assert gap < 1e-5
    with pytest.raises(ValueError, match="exceed model.seq_length=32"):
        model.decode(ids[:, :1], cache)


def test_sampling_is_reproducible_for_a_seed():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(greedy=False, temperature=1.5)

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.stack([next_token(logits, sampling, gen) for _ in range(20)]).tolist()

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert torch.equal(next_token(logits, Sampling()), logits.argmax(-1))


def test_top_k_keeps_the_k_most_likely():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    kept = top_k_filter(logits, 5).isfinite()
    assert kept.sum(-1).tolist() == [5, 5, 5]
    assert torch.equal(
        kept.nonzero()[:, 1].view(3, 5).sort(-1).values, logits.topk(5).indices.sort(-1).values
    )
    gen = torch.Generator().manual_seed(0)
    sampling = Sampling(greedy=False, top_k=5, temperature=10.0)  # flat: every kept token drawn
    drawn = torch.stack([next_token(logits, sampling, gen) for _ in range(300)], dim=1)
    for row in range(3):
        assert set(drawn[row].tolist()) == set(logits[row].topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for p, n in ((0.4, 1), (0.6, 2), (0.7, 2), (0.9, 3), (0.97, 4), (1.0, 4)):
        kept = top_p_filter(logits, p).isfinite()[0]
        assert kept.tolist() == [True] * n + [False] * (4 - n), p


def test_filters_keep_what_transformers_keeps():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2)) * 3
    sampling = Sampling(greedy=False, temperature=0.7, top_k=30, top_p=0.8)
    theirs = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(30), TopPLogitsWarper(0.8)):
        theirs = warper(None, theirs)
    ours = filtered_logits(logits, sampling)
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    assert torch.allclose(ours[ours.isfinite()], theirs[theirs.isfinite()])


def test_temperature_scales_the_logits():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    for t in (0.5, 2.0):
        assert torch.equal(
            filtered_logits(logits, Sampling(greedy=False, temperature=t)), logits / t
        )
    sharp = filtered_logits(logits, Sampling(greedy=False, temperature=0.5)).softmax(-1)
    flat = filtered_logits(logits, Sampling(greedy=False, temperature=2.0)).softmax(-1)
    assert (sharp.max(-1).values > flat.max(-1).values).all()
    for bad in ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampling(greedy=False, **bad)


def test_generation_stops_at_eos(workdir):
    model = load_model(checkpoint(workdir, "llama")).model
    prompt = prompts()[:2]
    free = generate(model, prompt, 20).ids[:, 5:]  # no EOS: the full length
    assert free.shape == (2, 20)
    eos = free[0, 3].item()  # a token the first row produces at its 4th step
    first = [(row == eos).nonzero()[0, 0].item() if (row == eos).any() else 20 for row in free]
    out = generate(model, prompt, 20, eos_id=eos)
    new = out.ids[:, 5:]
    assert out.new_tokens == min(20, max(first) + 1) == new.shape[1]
    assert out.stopped_at_eos == (max(first) < 20)
    for row, stop in enumerate(first):  # identical up to its EOS, then EOS only
        end = min(stop + 1, new.shape[1])
        assert torch.equal(new[row, :end], free[row, :end])
        assert (new[row, stop:] == eos).all()


@pytest.fixture(scope="module")
def run_ckpt(workdir, stdlib_cache) -> str:
    """A checkpoint whose config names the small built-in corpus (512-piece tokenizer)."""
    path = str(workdir / "stdlib-run")
    data = [f"data.cache_dir={stdlib_cache}", "data.vocab_size=512", "data.max_corpus_mb=0.5"]
    train_layout(0, 1, [*data, "model.vocab_size=512", *SEQ], 4, None, path)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatronish.generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.slow
def test_cli_prints_the_prompt_and_its_continuation(run_ckpt):
    done = cli(f"checkpoint={run_ckpt}", "prompt=def ", "max_new_tokens=12")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def ") and len(done.stdout.rstrip("\n")) > len("def ")
    assert "step 4" in done.stderr and "tokens/s" in done.stderr


def test_cli_options_and_errors(run_ckpt, stdlib_cache, capsys):
    step = os.path.join(run_ckpt, "step_0000004")
    sample = [
        f"checkpoint={step}",
        "prompt=import ",
        "max_new_tokens=10",
        "temperature=0.9",
        "top_k=50",
        "seed=3",
    ]
    assert main(sample) == 0
    first = capsys.readouterr().out
    assert main(sample) == 0 and capsys.readouterr().out == first  # seeded
    assert first.startswith("import ")

    model = next(Path(stdlib_cache).rglob("tokenizer.model"))
    assert (
        main([f"checkpoint={step}", "prompt=''", "max_new_tokens=3", f"tokenizer_model={model}"])
        == 0
    )
    assert "stopped at" in capsys.readouterr().err

    cases = [
        (["prompt=x", f"checkpoint={step}", "greedy=true", "top_k=5"], 2, "greedy=true takes"),
        (["prompt=x", f"checkpoint={step}", "max_new_tokens=0"], 2, "max_new_tokens=0: expected"),
        (["prompt=x", f"checkpoint={step}", "temprature=0.5"], 2, "unknown option temprature"),
        (["prompt=x", f"checkpoint={step}", "parallel.tp=2"], 2, "one process (tp=cp=pp=1)"),
        ([f"checkpoint={step}"], 2, "prompt=TEXT is required"),
        (["prompt=" + "x = 1\n" * 20, f"checkpoint={step}"], 2, "longer than the model's context"),
        (["prompt=x", f"checkpoint={step}", "max_new_tokens=40"], 2, "use max_new_tokens<="),
        (["prompt=x", f"checkpoint={step}", "tokenizer_model=/nope.model"], 3, "/nope.model"),
        (["prompt=x", f"checkpoint.dir={run_ckpt}", "device=tpu"], 2, "device=tpu: expected"),
        (["prompt=x", "checkpoint.dir=null"], 2, "checkpoint.dir is null"),
        (
            [f"checkpoint={run_ckpt}", "prompt=x", "top_p=2"],
            2,
            "invalid option: top_p=2.0 must be in (0, 1]",
        ),
        (["checkpoint=/nonexistent/ckpt", "prompt=x"], 3, "no checkpoint at /nonexistent/ckpt"),
    ]
    for argv, code, message in cases:
        assert main(argv) == code, argv
        out, err = capsys.readouterr()
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert out == "", (argv, out)

    assert main(["prompt=x", f"checkpoint.dir={run_ckpt}", "max_new_tokens=2"]) == 0  # the run's
    assert "step 4" in capsys.readouterr().err

    damaged = os.path.join(str(Path(run_ckpt).parent), "damaged")
    shutil.copytree(run_ckpt, damaged)
    shard = os.path.join(damaged, "step_0000004", "model-rank00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main([f"checkpoint={damaged}", "prompt=x"]) == 3
    err = capsys.readouterr().err
    assert "model-rank00000.safetensors" in err and len(err.strip().splitlines()) == 1


def test_the_run_tokenizer_of_indexed_blended_and_stdlib_runs():
    from megatronish.generate.tokenizer import run_tokenizer_path

    indexed = {"data": {"source": "indexed", "tokenizer_model": "/t/spm.model"}}
    blended = {"data": {"blend": [[1.0, "/d/web"]], "tokenizer_model": "/t/spm.model"}}
    assert run_tokenizer_path(indexed) == run_tokenizer_path(blended) == "/t/spm.model"
    stdlib = run_tokenizer_path(
        {"data": {"cache_dir": "/c", "vocab_size": 512, "max_corpus_mb": 0.5}}
    )
    assert stdlib.startswith("/c/stdlib-py") and stdlib.endswith("-v512-0.5mb/tokenizer.model")


def test_padded_and_unused_vocabulary_ids_are_never_generated(workdir):
    """The head's rows past the real vocabulary (padding to a multiple of 128, or pieces the
    tokenizer does not have) give the largest logits here: greedy and sampled decoding still
    draw only ids below ``vocab_size`` (default: the model's real vocabulary)."""
    model = load_model(checkpoint(workdir, "llama")).model
    assert model.spec.padded_vocab_size > VOCAB == model.spec.vocab_size
    real_decode, real = model.decode, {}

    def padding_wins(ids, cache):  # +1e4 on the logits of every id from real["size"] on
        logits = real_decode(ids, cache)
        assert logits.shape[-1] == model.spec.padded_vocab_size
        cut = real["size"]
        return torch.cat([logits[..., :cut], logits[..., cut:] + 1e4], dim=-1)

    model.decode = padding_wins
    for size, vocab_size in ((VOCAB, None), (VOCAB, VOCAB), (200, 200)):
        real["size"] = size
        for sampling in (Sampling(), Sampling(greedy=False, temperature=2.0)):
            gen = torch.Generator().manual_seed(5)
            new = generate(model, prompts(), 20, sampling, None, gen, vocab_size).ids[:, 5:]
            assert new.shape == (3, 20) and int(new.max()) < size, (size, sampling, new)
