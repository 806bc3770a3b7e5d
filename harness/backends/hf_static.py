"""The ``hf_static`` engine: the hf backend's sampling with a static KV cache, whose decode step transformers compiles
(torch.compile, CUDA graphs) on a GPU: a rollout engine where vLLM cannot be installed.

Same contract as :class:`harness.backends.hf.HFBackend` (per-row seeded sampling with the same draws, stop strings,
EOS kept, untempered log-probs of the sampled tokens), with three differences:

* the KV cache is ``cache_implementation="static"`` (preallocated for prompt width + ``max_new_tokens``), so the
  decode step has fixed shapes and ``model.generate`` compiles it on CUDA (``compile: auto``; ``true`` compiles on any
  device, ``false`` never). Prompts are left-padded to a multiple of ``width_multiple`` (default 64) so a rollout's
  varied prompt lengths give few distinct shapes; each new (batch, width, max_new_tokens) shape compiles once;
* the sampled tokens' log-probs are taken at each step from that step's logits (:class:`ScoredRowSampler`) instead
  of keeping all (b, new, V) logits until the end (the hf backend's way: 159 GB in fp32 for 256 rows × 1k tokens at
  a 152k vocabulary);
* the batch runs to the longest row: a finished row still occupies its slot (no continuous batching).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from harness.backends import SamplingParams, as_bool
from harness.backends.hf import HFBackend
from harness.backends.sampling import ScoredRowSampler


class StaticCacheBackend(HFBackend):
    """:class:`HFBackend` generating with a static KV cache (compiled decode on CUDA) and per-step log-probs."""

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

    def _sample(
        self, ids: torch.Tensor, attn: torch.Tensor, seeds: list[int], params: SamplingParams, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.generate`` with a static cache; the new tokens (b, new) and their log-probs recorded step by step."""
        sampler = ScoredRowSampler(seeds, params.temperature, params.top_p, self.device)
        kwargs.update(logits_processor=LogitsProcessorList([sampler]), cache_implementation="static", **self._compile_options())
        result = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        new_tokens = result.sequences[:, ids.shape[1] :]
        return new_tokens.cpu(), sampler.logprobs()[:, : new_tokens.shape[1]].float().cpu()

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
