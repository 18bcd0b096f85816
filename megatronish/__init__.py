"""megatronish: config-driven GPT pretraining with tp, sp, cp, pp, dp and ep parallelism."""

__version__ = "0.1.0"
