"""The episode spine: one rollout path for evaluation and training, multi-turn contexts, masks, step indices,
observation rendering, concurrency of environment steps, and that every environment is closed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.replay import ReplayBackend
from opd_harness.episode import Env, Observation, StepResult, render_observation
from opd_harness.evaluation import evaluate_task
from opd_harness.rollout import reference_trajectories, rollout
from opd_harness.trajectory import to_tensor_batch
from opd_harness.task import Problem, Score, Task, TaskOptions

CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class EchoOptions(TaskOptions):
    turns: int = 3  # model turns before the environment says done
    role: str = "inline"
    step_sleep_s: float = 0.0
    fail_at: int | None = None  # a step that raises (infrastructure failure)
    max_context_tokens: int | None = None
    outcome_fails: bool = False  # collecting the episode's outcome raises (infrastructure failure)
    done_observation: str | None = None  # the observation returned with done (none by default)


class EchoEnv(Env):
    """Answers every model turn with ``[obs N]``; done after ``turns`` turns; records its lifecycle."""

    stop = ("#",)

    def __init__(self, task: "EchoTask", prompt: str) -> None:
        self.task, self.prompt, self.n = task, prompt, 0
        self.max_turns = 10
        self.closed = False
        self.done_seen, self.steps_after_done = False, 0
        task.envs.append(self)

    def reset(self) -> str:
        return self.prompt

    def step(self, model_text: str) -> StepResult:
        opts = self.task.options
        with self.task.lock:
            self.task.active += 1
            self.task.peak = max(self.task.peak, self.task.active)
        try:
            time.sleep(opts.step_sleep_s)
            self.steps_after_done += self.done_seen  # a rollout must never step an environment that said done
            self.n += 1
            if opts.fail_at == self.n:
                raise RuntimeError("tool backend down")
            done = self.n >= opts.turns
            if done:
                self.done_seen = True
                return StepResult(None if opts.done_observation is None else Observation(opts.done_observation, role=opts.role), True)
            return StepResult(Observation(f"[obs {self.n}]", role=opts.role), False)
        finally:
            with self.task.lock:
                self.task.active -= 1

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.n), "invalid_tool_calls": 0.0, "tool_errors": 0.0}

    def outcome(self) -> dict:
        if self.task.options.outcome_fails:
            raise ConnectionError("sandbox gone")
        return {"steps_seen": self.n}

    def close(self) -> None:
        self.closed = True


class EchoTask(Task):
    name = "echo"
    description = "test task"
    Options = EchoOptions
    multi_turn = True

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.envs: list[EchoEnv] = []
        self.lock = threading.Lock()
        self.active = self.peak = 0

    def read_problems(self, split, data_dir):
        return [Problem(id=f"p{i}", question=f"Q{i}:", answer="x") for i in range(4)]

    def env(self, problem, tokenizer) -> EchoEnv:
        return EchoEnv(self, self.format_prompt(problem, tokenizer))

    def grade_many(self, problems, completions):
        return [Score("pass" if "obs" in c else "fail") for c in completions]

    @property
    def grader(self):
        return ("echo", "1")


@pytest.fixture
def backend(tiny_model_factory, char_tokenizer):
    return HFBackend(tiny_model_factory(seed=3), char_tokenizer, batch_size=16)


def scripted(task: EchoTask, turns: list[str], n: int = 1) -> ReplayBackend:
    return ReplayBackend({(task.name, p.id): [list(turns)] * n for p in task.load()})


def test_multi_turn_episode_interleaves_model_and_environment_tokens(char_tokenizer):
    task = EchoTask(EchoOptions(turns=3))
    trajs = rollout(scripted(task, ["a#", "bb#", "ccc"]), task, task.load()[:1], SamplingParams(n=1))
    (traj,) = trajs
    assert [(s.kind, s.text) for s in traj.segments] == [
        ("model", "a#"), ("env", "[obs 1]"), ("model", "bb#"), ("env", "[obs 2]"), ("model", "ccc"),
    ]  # fmt: skip
    assert [s.step for s in traj.model_segments] == [0, 1, 2]
    assert traj.metadata["episode"]["turns"] == 3 and traj.metadata["episode"]["stop_reason"] == "done"
    assert traj.metadata["episode"]["tool_calls"] == 3
    batch = to_tensor_batch(trajs, char_tokenizer.pad_token_id)
    n_prompt = len(traj.prompt_ids)
    expected_mask = [0] * n_prompt + [1] * 2 + [0] * 7 + [1] * 3 + [0] * 7 + [1] * 3
    assert batch.loss_mask[0].tolist() == expected_mask
    expected_steps = [-1] * n_prompt + [0] * 2 + [-1] * 7 + [1] * 3 + [-1] * 7 + [2] * 3
    assert batch.step_index[0].tolist() == expected_steps
    assert all(e.closed for e in task.envs)


def test_observations_use_the_chat_template_role(char_tokenizer):
    import copy

    templated = copy.deepcopy(char_tokenizer)  # the fixture is session-wide: change a copy
    templated.chat_template = CHATML
    text = render_observation(Observation("out", role="tool"), templated)
    assert text == "<|end|>\n<|tool|>out<|end|>\n<|assistant|>"  # closes the assistant turn, tool message, new turn
    assert render_observation(Observation("out", role="tool", raw="<r>out</r>"), char_tokenizer) == "<r>out</r>"  # no template: raw
    assert render_observation(Observation("out", role="inline", raw="<i>out</i>"), templated) == "<i>out</i>"  # inline: never templated
    task = EchoTask(EchoOptions(turns=2, role="user", use_chat_template=True))
    replay = scripted(task, ["a#", "b"])
    replay.tokenizer = templated
    (traj,) = rollout(replay, task, task.load()[:1], SamplingParams())
    assert traj.prompt_text == "<|user|>Q0:<|end|>\n<|assistant|>"
    assert traj.segments[1].kind == "env" and traj.segments[1].text == "<|end|>\n<|user|>[obs 1]<|end|>\n<|assistant|>"


def test_env_steps_run_concurrently_and_generation_is_batched(backend):
    task = EchoTask(EchoOptions(turns=2, step_sleep_s=0.3))
    calls: list[int] = []
    original = backend.generate
    backend.generate = lambda prompts, params: calls.append(len(prompts)) or original(prompts, params)  # type: ignore[method-assign]
    started = time.perf_counter()
    trajs = rollout(backend, task, task.load(), SamplingParams(max_new_tokens=3, n=2, seed=0), batch_window_s=0.25)
    elapsed = time.perf_counter() - started
    assert len(trajs) == 8 and all(t.num_steps == 2 for t in trajs)
    assert calls == [8, 8]  # steps that return together: every ready episode in one generate call
    assert task.peak > 1  # environment steps overlapped
    assert elapsed < 8 * 2 * 0.3  # far below one-at-a-time (4.8 s)
    assert all(t.timings["env_s"] >= 0.6 for t in trajs) and all(t.timings["generate_s"] > 0 for t in trajs)


def test_failing_environment_is_an_error_grade_and_every_env_is_closed(backend):
    task = EchoTask(EchoOptions(turns=3, fail_at=2))
    result = evaluate_task(backend, task, task.load(), k=1, sampling=SamplingParams(max_new_tokens=2, seed=0), n_resamples=100)
    assert {s.status for s in result.samples} == {"error"}
    assert all("tool backend down" in s.details for s in result.samples)
    assert result.summary["n_errors"] == 4 and result.summary["n_problems"] == 0
    assert all(e.closed for e in task.envs) and len(task.envs) == 4


def test_environments_are_closed_when_generation_fails(backend):
    task = EchoTask(EchoOptions(turns=3))

    def boom(prompts, params):
        raise KeyboardInterrupt  # a killed rollout

    backend.generate = boom  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        rollout(backend, task, task.load(), SamplingParams(n=2))
    assert len(task.envs) == 8 and all(e.closed for e in task.envs)


def test_context_budget_ends_the_episode_and_counts_an_unplaceable_observation(char_tokenizer):
    task = EchoTask(EchoOptions(turns=5, max_context_tokens=12))  # prompt "Q0:" = 3 tokens
    replay = scripted(task, ["abcd#", "efgh#", "x"])
    replay.counts_tokens = True  # a model's own tokens: budgets apply (replayed characters are exempt)
    (traj,) = rollout(replay, task, task.load()[:1], SamplingParams())
    assert len(traj.prompt_ids) + len(traj.response_ids) <= 12
    episode = traj.metadata["episode"]
    assert episode["stop_reason"] == "context" and episode["context_overflows"] == 1 and episode["invalid_tool_calls"] == 1


def test_done_with_an_observation_that_does_not_fit_ends_the_episode(char_tokenizer):
    """An environment that ends the episode (budget, format-error limit) with a final observation too big for the
    context: the episode is over, the environment is never stepped again and nothing is counted as an overflow."""
    task = EchoTask(EchoOptions(turns=2, max_context_tokens=40, done_observation="x" * 200))
    replay = scripted(task, ["ab#"] * 10)
    replay.counts_tokens = True
    (traj,) = rollout(replay, task, task.load()[:1], SamplingParams())
    (env,) = task.envs
    assert env.n == 2 and env.steps_after_done == 0
    episode = traj.metadata["episode"]
    assert episode["stop_reason"] == "done" and episode["turns"] == 2 and "context_overflows" not in episode
    assert [s.kind for s in traj.segments] == ["model", "env", "model"]  # the observation that does not fit is not appended


def test_an_opening_context_that_does_not_fit_is_an_error_not_a_fail(backend):
    task = EchoTask(EchoOptions(turns=2, max_context_tokens=3))  # prompt "Q0:" = 3 tokens: no room for a first token
    result = evaluate_task(backend, task, task.load(), k=1, sampling=SamplingParams(max_new_tokens=2, seed=0), n_resamples=100)
    assert {s.status for s in result.samples} == {"error"}
    assert all("opening context is 3 tokens, the context budget 3" in s.details for s in result.samples)
    assert all(e.closed for e in task.envs)


def test_max_turns_caps_the_episode():
    task = EchoTask(EchoOptions(turns=100))
    (traj,) = rollout(scripted(task, ["a#"] * 20), task, task.load()[:1], SamplingParams())
    assert traj.num_steps == 10 and traj.metadata["episode"]["stop_reason"] == "max_turns"


def test_multi_turn_reference_trajectory_matches_a_live_episode(char_tokenizer):
    task = EchoTask(EchoOptions(turns=2))
    problem = Problem(
        "p0",
        "Q0:",
        "x",
        meta={"reference_turns": [{"model": "a#", "observation": {"content": "[obs 1]", "role": "inline"}}, {"model": "b"}]},
    )
    (ref,) = reference_trajectories(task, [problem], char_tokenizer)
    (live,) = rollout(scripted(task, ["a#", "b"]), task, [problem], SamplingParams())
    assert ref.prompt_ids + ref.response_ids == live.prompt_ids + live.response_ids + [char_tokenizer.eos_token_id]
    assert [s.kind for s in ref.segments] == ["model", "env", "model"] and [s.step for s in ref.model_segments] == [0, 1]


def test_evaluation_and_training_roll_out_the_same_trajectories(backend):
    """One path: the trainer's batch and an evaluation with the same seed and sampling give identical episodes."""
    from types import SimpleNamespace

    from opd_harness.config import RunConfig
    from opd_harness.registry import METHODS
    from opd_harness.trainers.pipeline import generate_batch, step_seed

    task = EchoTask(EchoOptions(turns=2))
    problems = task.load()
    cfg = RunConfig.model_validate(
        {"method": "opd", "task": "arith", "trainer": {"samples_per_prompt": 2, "max_new_tokens": 3, "temperature": 1.0}}
    )
    method = METHODS.get("opd")
    plan = SimpleNamespace(config=cfg, task=task, method=method, hparams=method.hparams())
    _, trained = generate_batch(plan, backend, problems, 5, {})
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=step_seed(cfg.seed, 5))
    evaluated = evaluate_task(backend, task, problems, k=2, sampling=params, n_resamples=10).trajectories
    assert [t.prompt_ids + t.response_ids for t in trained] == [t.prompt_ids + t.response_ids for t in evaluated]
    assert [[s.behaviour_logprobs for s in t.model_segments] for t in trained] == [
        [s.behaviour_logprobs for s in t.model_segments] for t in evaluated
    ]


def next_token_logprobs_by_hand(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from one unpadded forward pass: log_softmax of the logits, gathered here."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]


def test_old_and_teacher_logprobs_are_scored_on_the_interleaved_context(backend, tiny_model_factory):
    """π_old (the trainer's re-scoring) and the teacher's log-probs (``score_teacher``) of every sampled token, on the
    padded batch, equal a forward pass of each model over that episode's own interleaved context (prompt, model and
    environment tokens) computed here; π_old also equals the generation-time log-probs (ratio 1 at lag 0). Environment
    tokens, the prompt and padding carry no teacher log-prob."""
    from opd_harness.trainers.pipeline import behaviour_logprobs
    from opd_harness.trainers.teacher import score_teacher

    task = EchoTask(EchoOptions(turns=3))
    trajs = rollout(backend, task, task.load(), SamplingParams(max_new_tokens=4, n=2, seed=1))
    assert all([s.kind for s in t.segments] == ["model", "env", "model", "env", "model"] for t in trajs)
    batch = to_tensor_batch(trajs, backend.pad_id)
    teacher_model = tiny_model_factory(seed=11, hidden=48)
    score_teacher(HFBackend(teacher_model, backend.tokenizer), batch)
    old = behaviour_logprobs(backend, batch)
    mask = batch.loss_mask > 0
    for row, traj in enumerate(trajs):
        ids = traj.prompt_ids + traj.response_ids
        trained = [t for t in range(1, len(ids)) if mask[row, t]]
        by_hand = {"student": next_token_logprobs_by_hand(backend.model, ids), "teacher": next_token_logprobs_by_hand(teacher_model, ids)}
        assert old[row, trained].tolist() == pytest.approx([by_hand["student"][t - 1] for t in trained], abs=1e-4)
        assert batch.teacher_logprobs[row, trained].tolist() == pytest.approx([by_hand["teacher"][t - 1] for t in trained], abs=1e-4)
    assert old[mask].tolist() == pytest.approx(batch.behaviour_logprobs[mask].tolist(), abs=1e-4)  # generation-time log-probs
    assert (batch.teacher_logprobs[~mask] == 0).all()


@pytest.fixture
def eos_padded_backend(tiny_model_factory):
    """An HF backend whose tokenizer has no pad token of its own (as most chat models'): it pads with EOS."""
    from opd_harness.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    backend = HFBackend(tiny_model_factory(seed=3), tokenizer, batch_size=64)
    assert backend.pad_id == backend.eos_id
    return backend


def test_no_unsampled_token_is_trained_on_when_padding_is_eos(eos_padded_backend, monkeypatch):
    """Rows that stop on a stop string while others still generate are padded with EOS; only what was sampled, up to the
    first stop, enters the trajectory (with its log-prob and loss mask 1). The oracle: the raw generated rows (the hf
    engine's decode loop's output, EOS-padded after each row's stop), cut here at the first EOS or stop character (one
    character is one token)."""
    import opd_harness.backends.hf as hf

    backend, tokenizer = eos_padded_backend, eos_padded_backend.tokenizer
    stops = tuple("bcfghijlmqrtvwxyz")  # no character of <pad>, <eos>, <unk>: transformers matches stop strings inside a token
    raw: list[tuple[torch.Tensor, int]] = []
    decode_loop = hf.decode_loop

    def recording(model, ids, *args, **kwargs):
        new = decode_loop(model, ids, *args, **kwargs)
        raw.append((new.cpu(), ids.shape[1]))
        return new

    monkeypatch.setattr(hf, "decode_loop", recording)
    task = EchoTask(EchoOptions(turns=1))
    trajs = rollout(backend, task, task.load(), SamplingParams(max_new_tokens=12, n=8, stop=stops, seed=0))
    ((rows, _),) = raw
    enders = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids([*stops, *EchoEnv.stop])}
    ends = [next((i + 1 for i, t in enumerate(row) if t in enders), None) for row in rows.tolist()]  # None: ran to the limit
    sampled = [rows.shape[1] if n is None else n for n in ends]
    segments = [t.model_segments[0] for t in trajs]
    assert [s.token_ids for s in segments] == [row[:n] for row, n in zip(rows.tolist(), sampled, strict=True)]
    padded = [s for s, n in zip(segments, sampled, strict=True) if n < rows.shape[1] and s.text[-1:] in stops + EchoEnv.stop]
    assert len(padded) >= 5  # the case under test happened: rows that stopped on a stop string and were then padded with EOS
    batch = to_tensor_batch(trajs, backend.pad_id)
    assert batch.loss_mask.sum(-1).tolist() == [float(n) for n in sampled]
    assert [len(s.behaviour_logprobs) for s in segments] == sampled
    assert [s.finish_reason for s in segments] == ["length" if n is None else "stop" for n in ends]


def test_sod_steps_are_the_model_turns(char_tokenizer):
    """SOD's steps (maximal runs of trained tokens) are exactly the episode's model turns."""
    from opd_harness.trainers.objectives.sod import step_ids

    task = EchoTask(EchoOptions(turns=3))
    trajs = rollout(scripted(task, ["ab#", "c#", "def"], n=2), task, task.load()[:2], SamplingParams(n=2))
    batch = to_tensor_batch(trajs, char_tokenizer.pad_token_id)
    model = batch.loss_mask > 0
    assert torch.equal(step_ids(batch.loss_mask)[model], batch.step_index[model] + 1)
    assert torch.equal(step_ids(batch.loss_mask, batch.step_index)[model], batch.step_index[model] + 1)
    assert int(step_ids(batch.loss_mask).max()) == 3


def test_outcome_is_kept_for_grading_and_its_failure_is_an_error_grade(backend):
    task = EchoTask(EchoOptions(turns=2))
    (traj,) = rollout(scripted(task, ["a#", "b"]), task, task.load()[:1], SamplingParams())
    assert traj.metadata["outcome"] == {"steps_seen": 2}
    task = EchoTask(EchoOptions(turns=2, outcome_fails=True))
    result = evaluate_task(backend, task, task.load(), k=1, sampling=SamplingParams(max_new_tokens=2, seed=0), n_resamples=10)
    assert {s.status for s in result.samples} == {"error"} and "sandbox gone" in result.samples[0].details
    assert all(e.closed for e in task.envs)


def test_declared_episode_flags_become_rates():
    from opd_harness.evaluation import summarize_episodes

    episodes = [
        {"turns": 3, "tool_calls": 2, "repeated_loop": 1.0},
        {"turns": 1, "tool_calls": 0},
        {"turns": 2, "tool_calls": 1, "repeated_loop": 0.0},
    ]
    summary = summarize_episodes(episodes, ("repeated_loop", "premature_stop"))
    assert summary["repeated_loop_rate"] == pytest.approx(1 / 3) and summary["premature_stop_rate"] == 0.0
    assert summary["mean_tool_calls"] == 1.0 and summary["mean_turns"] == 2.0
    assert summarize_episodes([{"turns": 1}, {"turns": 1}]) == {}  # single-turn: nothing agentic
