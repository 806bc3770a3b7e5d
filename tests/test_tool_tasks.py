"""ReTool tool-use episodes with scripted agents (multi-turn replay) in a real sandbox, both providers:
correct tool use, invalid calls, limits, timeouts as observations, persistent state, no leftover containers."""

from __future__ import annotations

import json
import os
import time

import pytest

from opd_harness.backends import SamplingParams
from opd_harness.backends.replay import ReplayBackend
from opd_harness.evaluation import evaluate_task
from opd_harness.registry import TASKS
from opd_harness.rollout import reference_trajectories, rollout
from opd_harness.tasks.agentic.tool_formats import HermesFormat, RetoolFormat

RT = RetoolFormat()
HERMES = HermesFormat()


def code(src: str) -> str:
    return RT.call_text(src)


def answer(value) -> str:
    return f"<answer>\\boxed{{{value}}}</answer>"


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def provider(request):
    if request.param == "docker":
        request.getfixturevalue("docker_client")  # skips (or fails under HARNESS_REQUIRE_DOCKER) without Docker
    return request.param


def make_task(provider: str, **options):
    cls = TASKS.get("arith_tool")
    sandbox_options = (
        {"network_isolation": "auto"} if provider == "local" else {"image": os.environ.get("HARNESS_SANDBOX_IMAGE", "opd-sandbox:bookworm")}
    )
    return cls(cls.Options(n_test=6, n_train=10, sandbox=provider, sandbox_options=sandbox_options, **options))


def play(task, scripts: list[list[str]], k: int = 1):
    """Evaluate ``task`` with one scripted agent (list of model turns) per problem."""
    problems = task.load("test")[: len(scripts)]
    replay = ReplayBackend({(task.name, p.id): [turns] * k for p, turns in zip(problems, scripts)})
    return evaluate_task(replay, task, problems, k=k, sampling=SamplingParams(), n_resamples=100), problems


def test_scripted_tool_use_solves_what_the_model_cannot(provider):
    with make_task(provider) as task:
        problems = task.load("test")[:3]
        exprs = [p.question.removeprefix("Compute ").strip().rstrip(".") for p in problems]
        scripts = [
            [code(f"x = {exprs[0]}\nprint(x)"), answer(problems[0].answer)],  # right: uses the tool, copies its output
            [code(f"print({exprs[1]})"), answer(int(problems[1].answer) + 1)],  # tool used, wrong answer
            [answer(problems[2].answer)],  # no tool, right answer
        ]
        result, _ = play(task, scripts)
    assert [s.status for s in result.samples] == ["pass", "fail", "pass"]
    first = result.trajectories[0]
    assert [s.kind for s in first.segments] == ["model", "env", "model"]
    assert first.segments[1].text == f"\n<interpreter>\n{problems[0].answer}\n</interpreter>\n"
    assert [s.metrics["tool_calls"] for s in result.samples] == [1, 1, 0]
    assert result.summary["mean_tool_calls"] == pytest.approx(2 / 3) and result.summary["invalid_tool_rate"] == 0.0


def test_interpreter_state_persists_and_errors_are_observations(provider):
    with make_task(provider, tool_timeout_s=2.0) as task:
        script = [
            code("import math\nsecret = 6 * 7\ndef twice(v):\n    return 2 * v"),
            code("print(twice(secret), math.factorial(5))"),
            code("1 / 0"),
            code("while True:\n    pass"),
            code("print(secret)"),  # still there after an exception and a timeout
            answer(42),
        ]
        result, _ = play(task, [script])
    (traj,) = result.trajectories
    observations = [s.text for s in traj.segments if s.kind == "env"]
    assert "84 120" in observations[1]
    assert "ZeroDivisionError" in observations[2]
    assert "TimeoutError" in observations[3]
    assert "42" in observations[4]
    metrics = result.samples[0].metrics
    assert metrics["tool_calls"] == 5 and metrics["tool_errors"] == 2 and metrics["invalid_tool_calls"] == 0
    assert result.samples[0].status == "fail"  # 42 is not this problem's answer; the episode itself is fine
    assert result.summary["tool_error_rate"] == pytest.approx(2 / 5)


class PausingReplay(ReplayBackend):
    """Replay that waits a second before each episode's second turn (so that what a cell left behind acts between cells)."""

    def generate(self, prompts, params, keys=None):
        if any(len(k) > 3 and k[3] == 1 for k in keys or ()):
            time.sleep(1.0)
        return super().generate(prompts, params, keys)


def test_a_cell_that_breaks_the_interpreter_is_its_episodes_observation_never_an_error(provider):
    """Issue 22 #12: a thread of the first cell kills the interpreter's supervisor between cells. The episode reads a
    crash (state lost) and is graded on its (wrong) answer; later episodes of the same task are unaffected. Before,
    on Docker, that episode and every later one were ``error``."""
    kill_later = (
        "import os, signal, threading, time\nsup = os.getppid()\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), os.kill(sup, signal.SIGKILL)), daemon=True).start()"
    )
    with make_task(provider) as task:
        problems = task.load("test")[:3]
        exprs = [p.question.removeprefix("Compute ").strip().rstrip(".") for p in problems]
        attack = [code(f"x = {exprs[0]}\n{kill_later}"), code("print(x)"), answer(int(problems[0].answer) + 1)]
        replay = PausingReplay({(task.name, problems[0].id): [attack]})
        result = evaluate_task(replay, task, problems[:1], k=1, sampling=SamplingParams(), n_resamples=100)
        assert [s.status for s in result.samples] == ["fail"]
        observation = [s.text for s in result.trajectories[0].segments if s.kind == "env"][1]
        assert "variables from earlier cells are lost" in observation and result.samples[0].metrics["tool_errors"] == 1
        turns = {(task.name, p.id): [[code(f"x = {e}"), code("print(x)"), answer(p.answer)]] for p, e in zip(problems, exprs)}
        later = ReplayBackend(turns)
        result = evaluate_task(later, task, problems[1:], k=1, sampling=SamplingParams(), n_resamples=100)
    assert [s.status for s in result.samples] == ["pass", "pass"]


@pytest.mark.parametrize(
    "bad_turn, reason",
    [
        ("<code>\nprint(1)\n</code>", "no ```python fenced block"),
        ("<code>\n```python\n\n```\n</code>", "empty code block"),
        ("<code>\n```python\nprint(1)\n", "unclosed <code> block"),
    ],
)
def test_malformed_blocks_are_invalid_calls(bad_turn, reason):
    with make_task("local") as task:
        result, problems = play(task, [[bad_turn, answer(0)]])
    (traj,) = result.trajectories
    assert reason in traj.segments[1].text
    assert result.samples[0].metrics["invalid_tool_calls"] == 1
    assert result.summary["invalid_tool_rate"] == 1.0


def test_hermes_format_and_its_invalid_calls():
    with make_task("local", format="hermes") as task:
        p = task.load("test")[0]
        expr = p.question.removeprefix("Compute ").strip().rstrip(".")
        good = [HERMES.call_text(f"print({expr})"), answer(p.answer)]
        bad_json = ['<tool_call>{"name": "code_interpreter", "arguments": {"code": </tool_call>', answer(p.answer)]
        bad_tool = ['<tool_call>{"name": "web_search", "arguments": {"query": "x"}}</tool_call>', answer(p.answer)]
        result, _ = play(task, [good])
        assert result.samples[0].status == "pass"
        assert result.trajectories[0].segments[1].text == f"\n<tool_response>\n{p.answer}\n</tool_response>\n"
        for script, why in ((bad_json, "not valid JSON"), (bad_tool, "unsupported tool 'web_search'")):
            result, _ = play(task, [script])
            assert why in result.trajectories[0].segments[1].text and result.samples[0].metrics["invalid_tool_calls"] == 1


def test_tool_call_and_turn_limits():
    with make_task("local", max_tool_calls=2, max_turns=4) as task:
        result, _ = play(task, [[code("print(1)")] * 6 + [answer(1)]])
    (traj,) = result.trajectories
    metrics = result.samples[0].metrics
    assert traj.num_steps == 4 and metrics["stop_reason"] == "max_turns"
    assert metrics["tool_calls"] == 2 and metrics["refused_tool_calls"] == 2
    assert "Tool call limit reached (2 calls)" in traj.segments[-1].text


def test_invalid_calls_use_the_budget_but_are_no_tool_error_denominator():
    """f-OPD App. B.1's six calls count every call, valid or not (an invalid one is refused a run, not a turn of the
    budget); the tool-error rate is over the calls that ran code, since an invalid call cannot raise."""
    with make_task("local", max_tool_calls=3) as task:
        bad = "<code>\nprint(1)\n</code>"
        result, _ = play(task, [[bad, code("1 / 0"), code("print(2)"), code("print(3)"), answer(2)]])
    metrics = result.samples[0].metrics
    assert metrics["tool_errors"] == 1 and result.summary["tool_error_rate"] == pytest.approx(1 / 2)  # not 1/3
    assert (metrics["tool_calls"], metrics["invalid_tool_calls"], metrics["executed_tool_calls"]) == (3, 1, 2)
    assert metrics["refused_tool_calls"] == 1 and "Tool call limit reached (3 calls)" in result.trajectories[0].segments[-2].text
    assert result.summary["invalid_tool_rate"] == 1.0


def test_the_swebench_agent_reports_the_same_tool_use_view(local_sb):
    """The shell agent's commands are tool calls as the interpreter's are: a format error is an invalid call that ran
    nothing, a timed-out command an executed call with a tool error."""
    from opd_harness.evaluation import summarize_episodes
    from opd_harness.sandbox import ExecRequest
    from opd_harness.tasks.agentic.shell_env import AgentLimits
    from opd_harness.tasks.swebench.agent import SwebenchAgentEnv

    def open_session():  # a one-commit repository: the agent diffs against its base commit
        session = local_sb.session()
        session.write_files({"repo/README": b"x\n"})
        commit = "cd repo && git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm base"
        assert session.run(ExecRequest(argv=["bash", "-c", commit], timeout_s=60)).exit_code == 0
        return session

    env = SwebenchAgentEnv("task", open_session, workdir="repo", limits=AgentLimits(command_timeout_s=1.0))
    try:
        for reply in ("no command here", "```bash\nsleep 5\n```", "```bash\necho hi\n```"):
            env.step(reply)
        metrics = env.metrics()
    finally:
        env.close()
    assert summarize_episodes([{**metrics, "turns": 3}])["tool_error_rate"] == pytest.approx(1 / 2)  # not 1/3
    assert (metrics["tool_calls"], metrics["invalid_tool_calls"], metrics["executed_tool_calls"], metrics["tool_errors"]) == (3, 1, 2, 1)


@pytest.mark.parametrize("value_width", [0, 10])
def test_reference_episodes_render_like_live_ones(value_width):
    """The SFT traces of arith_tool are token-for-token what a live episode with the same turns produces (also with the
    value printed zero-padded, whose padded answer grades as the value)."""
    operands = {"min_operand": 100, "max_operand": 999} if value_width else {}
    with make_task("local", value_width=value_width, **operands) as task:
        problem = task.load("train")[0]
        (ref,) = reference_trajectories(task, [problem], ReplayBackend({}).tokenizer)
        turns = [t["model"] for t in problem.meta["reference_turns"]]
        replay = ReplayBackend({(task.name, problem.id): [turns]})
        (live,) = rollout(replay, task, [problem], SamplingParams())
    assert ref.prompt_ids + ref.response_ids == live.prompt_ids + live.response_ids + [replay.tokenizer.eos_token_id]
    assert task.grade(problem, live).status == "pass"


def test_value_width_pads_the_reference_print_to_a_fixed_offset_and_refuses_a_narrow_one():
    with make_task("local", min_operand=100, max_operand=999, value_width=10) as task:
        problems = task.load("test")
    answers = [p.meta["reference_turns"][-1]["model"] for p in problems]
    assert {len(a) for a in answers} == {len(answer("0" * 10))}
    assert all(a == answer(f"{int(p.answer):010d}") for a, p in zip(answers, problems))
    narrow = make_task("local", min_operand=100, max_operand=999, value_width=3)
    with pytest.raises(ValueError, match="value_width 3 is too narrow"), narrow as task:
        task.load("test")


def leftover_containers(docker_client) -> list[str]:
    from opd_harness.sandbox.docker import LABEL, OWNER, OWNER_LABEL

    return [c["Id"] for c in docker_client.api.containers(all=True, filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={OWNER}"]})]


def busy_containers(docker_client, task, before: set[str]) -> set[str]:
    """This process's new containers but the task sandbox's idle, reset session containers (only their exec server,
    PID 1, is running: an episode that ended left nothing in it) and those reset with the next episode's supervisor
    started ahead (PID 1, the supervisor and its fresh worker)."""
    from opd_harness.sandbox.interpreter import _READY

    idle = {b.container.id for boxes in task.sandbox._idle_sessions.values() for b in boxes}
    assert all(len(docker_client.containers.get(c).top()["Processes"]) == 1 for c in idle), "an idle container was not reset"
    pool, deadline = _READY.get(task.sandbox), time.monotonic() + 60
    while pool is not None and sum(pool.pending.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    ready = {c.session.container_id for conns in (pool.ready.values() if pool else ()) for c in conns}
    assert all(len(docker_client.containers.get(c).top()["Processes"]) == 3 for c in ready), "a ready container runs more"
    return set(leftover_containers(docker_client)) - before - idle - ready


@pytest.mark.docker
def test_no_container_is_left_behind(docker_client):
    before = set(leftover_containers(docker_client))
    with make_task("docker") as task:
        problems = task.load("test")[:2]
        envs = []  # held, so that only close() (not garbage collection) can remove their containers
        make_env = task.env
        task.env = lambda problem, tokenizer: envs.append(make_env(problem, tokenizer)) or envs[-1]
        play(task, [[code("x = 1"), code("print(x)"), answer(1)], [code("import os\nos._exit(3)"), answer(2)]])
        assert busy_containers(docker_client, task, before) == set(), "an episode left its container running"

        class Boom(ReplayBackend):
            def generate(self, prompts, params, keys=None):
                if keys[0][3] == 1:
                    raise KeyboardInterrupt  # the rollout is killed after the first tool calls ran
                return super().generate(prompts, params, keys)

        killer = Boom({(task.name, p.id): [[code("y = 2"), answer(1)]] for p in problems})
        with pytest.raises(KeyboardInterrupt):
            rollout(killer, task, problems, SamplingParams())
        assert busy_containers(docker_client, task, before) == set(), "a killed rollout left containers"
        assert len(envs) == 4
    assert set(leftover_containers(docker_client)) - before == set(), "closing the task left containers"


@pytest.mark.docker
def test_check_ready_prewarms_sessions_that_the_first_episodes_take(docker_client):
    """``check_ready`` starts ``prewarm_sessions`` session containers in the background; the first episodes' interpreters
    take them (no container started for them), and closing the task removes them all."""
    before = set(leftover_containers(docker_client))
    with make_task("docker", prewarm_sessions=2) as task:
        task.check_ready()
        deadline = time.monotonic() + 120
        while task.sandbox.stats["sessions_prewarmed"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert task.sandbox.stats["sessions_prewarmed"] == 2
        created = task.sandbox.stats["created"]
        result, problems = play(task, [[code(f"print({p.question[8:-2]})"), answer(p.answer)] for p in task.load("test")[:2]])
        assert [s.status for s in result.samples] == ["pass", "pass"]
        # (each episode took a prewarmed container; on close its reset container took the next supervisor: reused again)
        assert task.sandbox.stats["sessions_reused"] >= 2 and task.sandbox.stats["created"] == created
    assert set(leftover_containers(docker_client)) - before == set(), "closing the task left containers"


@pytest.mark.slow
def test_retool_aime24_eval_with_replay_cli(tmp_path, benchmark_data):
    """`harness eval --task retool:aime24 --backend replay`: scripted agents with live tool calls, metrics in --json."""
    from typer.testing import CliRunner

    from opd_harness.cli import app

    data = benchmark_data("aime24/test.jsonl")
    rows = [json.loads(line) for line in (data / "aime24" / "test.jsonl").read_text().splitlines()[:2]]
    replay = tmp_path / "agent.jsonl"
    lines = [
        {"task": "retool:aime24", "id": rows[0]["id"], "turns": [code(f"print({rows[0]['answer']})"), answer(rows[0]["answer"])]},
        {"task": "retool:aime24", "id": rows[1]["id"], "turns": ["<code>print(1)</code>", answer(0)]},
    ]
    replay.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    args = ["eval", "--task", "retool:aime24", "--backend", "replay", "--model", str(replay), "--k", "1", "--limit", "2"]
    args += ["--task-arg", "retool:aime24.sandbox=local", "--data-dir", str(data), "--out", str(tmp_path / "out"), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["tasks"]["retool:aime24"]
    assert summary["n_pass"] == 1 and summary["invalid_tool_rate"] == 0.5 and summary["mean_tool_calls"] == 1.0
    from opd_harness.store import Store

    store = Store(tmp_path / "out")
    (ev,) = store.evals()
    assert ev["metrics"]["invalid_tool_rate"] == 0.5
    samples = store.samples(ev["run_id"], 0, "retool:aime24")
    assert "<interpreter>" in samples[0]["completion"] and samples[1]["metrics"]["invalid_tool_calls"] == 1
