"""Data pipeline: sentencepiece tokenizer, Megatron-compatible .bin/.idx files, GPT samples."""
