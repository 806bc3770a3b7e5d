"""Errors that end a run and that the command line reports; trainers raise subclasses of them."""

from __future__ import annotations


class TrainingAborted(RuntimeError):
    """A training run stopped on purpose; the message says why, the run's status ends ``failed``."""


class ConfigError(ValueError):
    """A bad configuration value; the CLI prints it and exits with code 2 (defined here, beside the command line's
    other errors, so that catching it imports no config models; ``opd_harness.config`` re-exports it)."""
