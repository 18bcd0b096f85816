"""Sampling text from a checkpoint: ``python -m megatronish.generate checkpoint=PATH prompt=...``.

The model of any checkpoint (any layout: tensors are stored globally) is loaded into one process
(tp = cp = pp = 1, :mod:`~megatronish.generate.session`), prompts are decoded a token at a time
with a KV cache (:mod:`~megatronish.generate.decode`), and the next token is chosen greedily or
drawn after temperature, top-k and top-p filtering (:mod:`~megatronish.generate.sampling`).
"""
