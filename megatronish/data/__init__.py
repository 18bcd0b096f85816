"""Data pipeline: tokenizers (sentencepiece, Hugging Face tokenizer.json), Megatron-compatible
.bin/.idx files, GPT samples."""
