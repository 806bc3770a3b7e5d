"""The ``hf_static`` engine: the hf backend's sampling with a static KV cache, whose decode step transformers compiles
(torch.compile, CUDA graphs) on a GPU: a rollout engine where vLLM cannot be installed.

Same contract and the same sampling path as :class:`opd_harness.backends.hf.HFBackend` (per-row seeded sampling with the
same draws, stop strings, EOS kept, the untempered log-probs of the sampled tokens recorded step by step by
:class:`opd_harness.backends.sampling.ScoredRowSampler`), with one difference, its :meth:`_generate_tokens`: where the hf
backend runs its own decode loop over a dynamic KV cache, this engine runs ``model.generate`` with
``cache_implementation="static"`` (preallocated for prompt width + ``max_new_tokens``), so the decode step has
fixed shapes and ``model.generate`` compiles it on CUDA (``compile: auto``; ``true`` compiles on any device,
``false`` never). Prompts are left-padded to a multiple of ``width_multiple`` (default 64) so a rollout's varied
prompt lengths give few distinct shapes; each new (batch, width, max_new_tokens) shape compiles once. As in ``hf``,
the batch runs to the longest row: a finished row still occupies its slot (no continuous batching).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from opd_harness.backends import as_bool
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.sampling import ScoredRowSampler


class StaticCacheBackend(HFBackend):
    """:class:`HFBackend` generating with a static KV cache (compiled decode on CUDA)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 64,
        device: str = "cpu",
        show_progress: bool = False,
        compile: bool | str = "auto",
        width_multiple: int = 64,
    ) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size, device=device, show_progress=show_progress)
        if width_multiple < 1:
            raise ValueError(f"width_multiple must be ≥ 1, got {width_multiple}")
        self.width_multiple = int(width_multiple)
        self.compile = "auto" if compile == "auto" else as_bool(compile)

    def _generate_tokens(self, ids: torch.Tensor, attn: torch.Tensor, sampler: ScoredRowSampler, kwargs: dict) -> torch.Tensor:
        """``model.generate`` greedy over what ``sampler`` leaves possible each step (the same tokens as the hf backend's
        loop), with a static KV cache and the compile switches."""
        kwargs.update(logits_processor=LogitsProcessorList([sampler]), **self._generate_options())
        return self.model.generate(input_ids=ids, attention_mask=attn, **kwargs).sequences[:, ids.shape[1] :]

    def _generate_options(self) -> dict:
        """A static KV cache, and the compile switches."""
        return {"cache_implementation": "static", **self._compile_options()}

    def _compile_options(self) -> dict:
        """generate's compile switches: ``auto`` leaves transformers' rule (compile on an accelerator with a static cache)."""
        if self.compile == "auto":
            return {}
        if not self.compile:
            return {"disable_compile": True}
        from transformers import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # transformers' own switch for compiling off an accelerator
        return {"compile_config": config}
