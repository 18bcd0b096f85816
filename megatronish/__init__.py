"""megatronish: config-driven 3D-parallel GPT pretraining."""

__version__ = "0.1.0"
