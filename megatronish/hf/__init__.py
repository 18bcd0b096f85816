"""Conversion to and from Hugging Face transformers checkpoints (Llama and GPT-2)."""
