"""A stand-in for a model that generates: it says scripted turns in order (the same script for every episode, one
episode per rollout), each call first running ``think(call number)`` (a test's probe, or a sleep), so environments
see a real generation between their opening and their first step (unlike replay, which asks for episode keys)."""

from __future__ import annotations

from collections.abc import Callable

from opd_harness.backends import Completion, SamplingParams
from opd_harness.backends.replay import char_id_table, char_ids
from opd_harness.models.tiny import build_char_tokenizer


class ScriptedModel:
    counts_tokens = False  # character ids: no token budgets

    def __init__(self, turns: list[str], think: Callable[[int], None] = lambda call: None) -> None:
        self.turns, self.think, self.calls = turns, think, 0
        self.tokenizer = build_char_tokenizer()
        self._ids = char_id_table(self.tokenizer)
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.think(self.calls)
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        return [Completion(char_ids(self._ids, text), [0.0] * len(text), text, "stop", i, 0) for i in range(len(prompts))]
