"""Runs inside vLLM's worker processes (``LLM(worker_extension_cls=...)``): reads back what the engine's model holds.

vLLM mixes :class:`WeightCheck` into its ``Worker`` class (``vllm/v1/worker/worker_base.py``,
``WorkerWrapperBase.init_worker``), so its methods can be called by name with ``LLM.collective_rpc`` and see the
worker's model through ``Worker.get_model()``. Only names, shapes and short hex digests cross the RPC boundary, never
tensors. This module must not import vllm at import time (the product imports it to name the class).
"""

from __future__ import annotations

import torch

from opd_harness.backends.weight_check import checksum

EXTENSION = f"{__name__}.WeightCheck"  # the qualified name vLLM resolves in each worker


class WeightCheck:
    """Worker methods the vLLM backend calls through ``collective_rpc`` after every weight update."""

    def harness_param_shapes(self) -> dict[str, list[int]]:
        """Every parameter of this worker's model: vLLM's name -> its shape here (a shard's, under tensor parallelism)."""
        return {name: list(param.shape) for name, param in self.get_model().named_parameters()}

    def harness_checksum(self, names: list[str], dtype: str | None = None) -> str:
        """:func:`~opd_harness.backends.weight_check.checksum` of the named parameters as this worker holds them now."""
        params = dict(self.get_model().named_parameters())
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"the engine's model has no parameters {missing}")
        return checksum({n: params[n] for n in names}, getattr(torch, dtype) if dtype else None)
