"""Packed documents against transformers: every document of a packed window (document masks,
positions reset) gets from megatronish the logits transformers' llama gives it run alone, on the
exported weights."""

import json

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from megatronish.data.documents import DocumentPacking
from megatronish.hf.to_hf import to_hf
from megatronish.testing.runs import build_trainer

EOD, VOCAB = 2, 250
LENGTHS = [[5, 1, 2, 4, 5], [1, 1, 3, 12]]  # a one-token document first, the last one cut


@torch.no_grad()
def test_every_packed_document_matches_transformers_llama_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    packed = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
    trainer = build_trainer(0, 1, ["model.rope_theta=500000", *packed], steps=1)
    chunk = trainer.chunks[0].eval()
    gen = torch.Generator().manual_seed(0)
    for p in chunk.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    rows = []
    for row in LENGTHS:
        w = torch.randint(3, VOCAB, (sum(row),), generator=gen)
        w[torch.tensor(row).cumsum(0)[:-1] - 1] = EOD
        rows.append(w)
    samples = [(w, torch.tensor(n).numpy()) for w, n in zip(rows, LENGTHS)]
    docs = DocumentPacking(EOD, reset_attention_mask=True, reset_position_ids=True).microbatch(
        samples, 1, 0, None
    )
    inputs = torch.stack(rows)[:, :-1]
    ours = chunk.head.logits(chunk(inputs, None, docs)).transpose(0, 1)[..., :VOCAB]

    tensors = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    config, state = to_hf(tensors, OmegaConf.to_container(trainer.cfg.model, resolve=True))
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    worst = 0.0
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            end = min(start + n, inputs.shape[1])
            theirs = hf(inputs[b : b + 1, start:end]).logits[0]
            worst = max(worst, (ours[b, start:end] - theirs).abs().max().item())
            start += n
    assert worst < 1e-5, f"packed megatronish vs transformers alone: {worst:.2e}"
