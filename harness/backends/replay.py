"""Replay backend: completions read from a JSONL file, to re-grade published outputs.

Rows are ``{"task": NAME, "id": PROBLEM_ID, "completion": TEXT}``; several rows with the same
(task, id) are several samples, in file order. Use it as ``harness eval --backend replay --model FILE``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from harness.backends import Completion, SamplingParams
from harness.models.tiny import build_char_tokenizer
from harness.registry import BACKENDS

REQUIRED = {"task": str, "id": (str, int), "completion": str}


def read_replay_file(path: Path) -> dict[tuple[str, str], list[str]]:
    """(task, id) → completions in file order; a bad row names file, line and field."""
    samples: dict[tuple[str, str], list[str]] = defaultdict(list)
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object")
            for field, kind in REQUIRED.items():
                if field not in row:
                    raise ValueError(f"{path}:{line_no}: field {field!r}: missing")
                if not isinstance(row[field], kind) or isinstance(row[field], bool):
                    raise ValueError(f"{path}:{line_no}: field {field!r}: expected {kind}, got {type(row[field]).__name__}")
            samples[(row["task"], str(row["id"]))].append(row["completion"])
    return dict(samples)


@BACKENDS.register("replay")
class ReplayBackend:
    """Serves stored completions by (task, problem id, sample index); never runs a model."""

    name = "replay"
    needs_episode_keys = True

    def __init__(self, samples: dict[tuple[str, str], list[str]], source: str = "") -> None:
        self.samples = samples
        self.source = source
        self.tokenizer = build_char_tokenizer()  # trajectories still carry token ids; characters suffice
        self.version = 0
        self.pad_id = self.tokenizer.pad_token_id

    @classmethod
    def load(cls, model: str, **options) -> "ReplayBackend":
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"--model {model!r}: the replay backend needs a JSONL file of completions")
        return cls(read_replay_file(path), source=str(path))

    def generate(self, prompts: list[list[int]], params: SamplingParams, keys: list[tuple[str, str, int]] | None = None) -> list[Completion]:
        """The stored completion for each (task, id, sample index) key; missing samples are an error."""
        if keys is None or len(keys) != len(prompts):
            raise ValueError("the replay backend needs a (task, id, sample) key per prompt")
        out = []
        for index, (task, problem_id, sample) in enumerate(keys):
            for s in range(params.n):
                stored = self.samples.get((task, problem_id), [])
                wanted = sample + s
                if wanted >= len(stored):
                    raise ValueError(
                        f"{self.source}: task {task!r} id {problem_id!r} has {len(stored)} completion(s), sample {wanted} was asked for (lower --k)"
                    )
                text = stored[wanted]
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                out.append(Completion(ids, [0.0] * len(ids), text, "stop", index, s))
        return out

    def score(self, *args, **kwargs):
        raise NotImplementedError("the replay backend holds no model and cannot score sequences")
