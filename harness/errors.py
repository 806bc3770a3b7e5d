"""Errors that end a run and that the command line reports; trainers raise subclasses of them."""

from __future__ import annotations


class TrainingAborted(RuntimeError):
    """A training run stopped on purpose; the message says why, the run's status ends ``failed``."""
