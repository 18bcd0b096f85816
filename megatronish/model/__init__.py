"""The GPT model (llama and gpt2 flavours) built from tensor-parallel layers."""
