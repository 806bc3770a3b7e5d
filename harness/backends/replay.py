"""Replay backend: model turns read from a JSONL file, to re-grade published outputs or run scripted agents.

Rows are ``{"task": NAME, "id": PROBLEM_ID, "completion": TEXT}`` (a single-turn sample) or
``{"task": NAME, "id": PROBLEM_ID, "turns": [TEXT, ...]}`` (a multi-turn sample: one element per model turn,
while the task's environment runs live, so tool calls really execute). Several rows with the same (task, id)
are several samples, in file order, unless a row gives ``"sample_index"``. A sample that runs out of turns
before its environment is done answers the next turns with empty text. Use it as
``harness eval --backend replay --model FILE``.

A stored turn is served up to ``max_turn_chars`` characters (``--backend-option max_turn_chars=N``, default 8 MiB);
a longer one is cut there with finish reason ``length``, as a model's turn at its token limit (a task's own bound,
such as swebench's ``max_patch_bytes``, then fails it). Token ids are one per character, looked up in a table
(linear time, about 16 bytes a character; the tokenizer's own per-token objects cost ~400 bytes a character).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opd_harness.backends import Completion, SamplingParams
from opd_harness.jsonout import json_object_line
from opd_harness.models.tiny import build_char_tokenizer

Sample = list[str]  # the model turns of one episode
MAX_TURN_CHARS = 8 << 20  # a longer stored turn is cut here (finish reason "length")


def char_id_table(tokenizer) -> np.ndarray:
    """Code point -> token id of a character-level tokenizer (its unknown token for characters it lacks)."""
    table = np.full(0x110000, tokenizer.unk_token_id, dtype=np.int32)
    for token, index in tokenizer.get_vocab().items():
        if len(token) == 1:
            table[ord(token)] = index
    return table


def char_ids(table: np.ndarray, text: str) -> list[int]:
    """The character tokenizer's ids of ``text``, without building its per-token encoding objects."""
    return table[np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)].tolist() if text else []


def row_error(path: Path, line: int, field: str, problem: str) -> ValueError:
    return ValueError(f"{path}:{line}: field {field!r}: {problem}")


def row_turns(path: Path, line: int, row: dict) -> Sample:
    """The turns of one row: ``turns`` (a non-empty list of strings) or ``completion`` (one string), not both."""
    if ("turns" in row) == ("completion" in row):
        raise row_error(path, line, "completion", "give exactly one of 'completion' (one turn) or 'turns' (a list of model turns)")
    if "completion" in row:
        if not isinstance(row["completion"], str):
            raise row_error(path, line, "completion", f"expected a string, got {type(row['completion']).__name__}")
        return [row["completion"]]
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise row_error(path, line, "turns", "expected a non-empty list of strings (one per model turn)")
    return list(turns)


def read_replay_file(path: Path) -> dict[tuple[str, str], list[Sample | None]]:
    """(task, id) → samples (each a list of turns) by sample index; a bad row names file, line and field."""
    path = Path(path)
    samples: dict[tuple[str, str], list[Sample | None]] = {}
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json_object_line(path, line_no, line)
            for name, kind in (("task", str), ("id", (str, int))):
                if name not in row:
                    raise row_error(path, line_no, name, "missing")
                if not isinstance(row[name], kind) or isinstance(row[name], bool):
                    raise row_error(path, line_no, name, f"expected {kind}, got {type(row[name]).__name__}")
            turns = row_turns(path, line_no, row)
            slots = samples.setdefault((row["task"], str(row["id"])), [])
            index = row.get("sample_index", len(slots))
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise row_error(path, line_no, "sample_index", f"expected an integer >= 0, got {index!r}")
            slots.extend([None] * (index + 1 - len(slots)))
            if slots[index] is not None:
                raise row_error(path, line_no, "sample_index", f"sample {index} of task {row['task']!r} id {row['id']!r} is given twice")
            slots[index] = turns
    return samples


class ReplayBackend:
    """Serves stored model turns by (task, problem id, sample index, turn); never runs a model."""

    presence_penalty = True  # ignores sampling altogether: it replays stored completions

    needs_episode_keys = True
    counts_tokens = False  # its token ids are characters, not the recorded model's tokens: token budgets do not apply

    def __init__(self, samples: dict[tuple[str, str], list[Sample | None]], source: str = "", max_turn_chars: int = MAX_TURN_CHARS) -> None:
        if int(max_turn_chars) < 1:
            raise ValueError(f"--backend-option max_turn_chars must be at least 1, got {max_turn_chars!r}")
        self.samples = samples
        self.source = source
        self.max_turn_chars = int(max_turn_chars)
        self.tokenizer = build_char_tokenizer()  # trajectories still carry token ids; characters suffice
        self._ids = char_id_table(self.tokenizer)
        self.version = 0
        self.pad_id = self.tokenizer.pad_token_id

    @classmethod
    def load(cls, model: str, max_turn_chars: int = MAX_TURN_CHARS, **options) -> "ReplayBackend":
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"--model {model!r}: the replay backend needs a JSONL file of completions")
        return cls(read_replay_file(path), source=str(path), max_turn_chars=max_turn_chars)

    def generate(self, prompts: list[list[int]], params: SamplingParams, keys: list[tuple] | None = None) -> list[Completion]:
        """The stored turn for each (task, id, sample index[, turn]) key; a missing sample is an error."""
        if keys is None or len(keys) != len(prompts):
            raise ValueError("the replay backend needs a (task, id, sample, turn) key per prompt")
        out = []
        for index, key in enumerate(keys):
            task, problem_id, sample = key[:3]
            turn = key[3] if len(key) > 3 else 0
            for s in range(params.n):
                turns = self.sample_turns(task, problem_id, sample + s)
                text = turns[turn] if turn < len(turns) else ""
                finish = "length" if len(text) > self.max_turn_chars else "stop"
                text = text[: self.max_turn_chars]
                ids = char_ids(self._ids, text)
                out.append(Completion(ids, [0.0] * len(ids), text, finish, index, s))
        return out

    def sample_turns(self, task: str, problem_id: str, sample: int) -> Sample:
        stored = self.samples.get((task, problem_id), [])
        if sample >= len(stored) or stored[sample] is None:
            have = sum(s is not None for s in stored)
            raise ValueError(f"{self.source}: task {task!r} id {problem_id!r} has {have} sample(s) and no sample {sample} (lower --k)")
        return stored[sample]  # type: ignore[return-value]

    def score(self, *args, **kwargs):
        raise NotImplementedError("the replay backend holds no model and cannot score sequences")
