"""The episode contract between a task's environment and the one rollout loop (:mod:`opd_harness.rollout`).

An environment gives the opening context (``reset``), consumes one model turn at a time (``step``) and
answers with an :class:`Observation` or nothing, and says when the episode is over. Each turn's stop
strings come from the environment (``Env.stop``, e.g. ``</code>``). ``close`` is always called, also when
the episode or the whole rollout fails, so an environment may own a sandbox session for its episode; ``prepare`` lets it
start that session while the model writes its first turn.

Observations are environment tokens (loss mask 0). They enter the context in the role the model expects:
``inline`` text is appended verbatim (the model continues its own turn, as in ReTool's ``<interpreter>``
blocks); a ``tool`` or ``user`` observation is rendered through the model's chat template (the assistant
turn is closed, the message is added and a new assistant turn is opened) or, without a template, appended
as its ``raw`` text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

ObservationRole = Literal["inline", "tool", "user"]
TEMPLATE_SENTINEL = "\x00HARNESS-ASSISTANT-TURN\x00"


@dataclass(frozen=True)
class Observation:
    """What the environment answers to a model turn: a message body, its role, and the raw text used
    when there is no chat template (default: the body itself)."""

    content: str
    role: ObservationRole = "tool"
    raw: str | None = None

    @property
    def raw_text(self) -> str:
        return self.content if self.raw is None else self.raw


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn."""

    observation: Observation | None
    done: bool


class Env(ABC):
    """One episode on one problem. ``max_turns`` caps the model turns (the rollout ends the episode there)."""

    stop: ClassVar[tuple[str, ...]] = ()
    max_turns: int = 1

    @abstractmethod
    def reset(self) -> str:
        """The opening context shown to the model (the formatted prompt)."""

    @abstractmethod
    def step(self, model_text: str) -> StepResult:
        """Consume one model turn; return the observation to append (or None) and whether the episode is over."""

    def prepare(self) -> None:
        """Start, in the background, what the first ``step`` needs (e.g. the episode's sandbox), so that it overlaps
        with the first generation; the rollout calls it after ``reset`` when a model generates. ``step`` waits for it,
        and ``close`` ends it, also while it is still starting."""

    def metrics(self) -> dict[str, float]:
        """Per-episode counters for the evaluation table (e.g. ``tool_calls``, ``invalid_tool_calls``, ``tool_errors``)."""
        return {}

    def outcome(self) -> dict:
        """What the episode produced beyond its text, collected just before ``close`` however the episode ended
        (e.g. the ``git diff`` of a repository an agent edited); kept in ``trajectory.metadata["outcome"]`` for grading."""
        return {}

    def close(self) -> None:
        """Release what the episode holds (e.g. its sandbox session); idempotent."""


class SingleTurnEnv(Env):
    """One model turn and done: the environment of every single-turn benchmark."""

    def __init__(self, prompt: str, stop: tuple[str, ...] = ()) -> None:
        self.prompt = prompt
        self.stop = tuple(stop)  # type: ignore[misc]

    def reset(self) -> str:
        return self.prompt

    def step(self, model_text: str) -> StepResult:
        return StepResult(None, True)


def has_chat_template(tokenizer, use_chat_template: bool = True) -> bool:
    """Whether contexts for this tokenizer go through its chat template."""
    return bool(use_chat_template and getattr(tokenizer, "chat_template", None))


def render_observation(observation: Observation, tokenizer, use_chat_template: bool = True) -> str:
    """The text an observation adds to the context: inline or template-less → its raw text; otherwise the
    chat template's own rendering of closing the assistant turn, the ``role`` message and a new assistant turn."""
    if observation.role == "inline" or not has_chat_template(tokenizer, use_chat_template):
        return observation.raw_text
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": TEMPLATE_SENTINEL}]
    message = {"role": observation.role, "content": observation.content}
    rendered = tokenizer.apply_chat_template([*probe, message], tokenize=False, add_generation_prompt=True)
    if TEMPLATE_SENTINEL not in rendered:
        raise ValueError("the chat template dropped the assistant turn; cannot place an observation after it")
    return rendered[rendered.index(TEMPLATE_SENTINEL) + len(TEMPLATE_SENTINEL) :]
