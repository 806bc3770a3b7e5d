"""opd-harness: evaluate and distil language models with on-policy distillation (OPD)."""

__version__ = "0.1.0"
