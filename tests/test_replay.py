import json

import pytest
from typer.testing import CliRunner

from opd_harness.backends.replay import read_replay_file
from opd_harness.cli import app
from opd_harness.tasks.synthetic.arith import ArithOptions, ArithTask

runner = CliRunner()


def test_replay_regrades_stored_completions(tmp_path):
    problems = ArithTask(ArithOptions()).load("test")[:5]
    path = tmp_path / "outputs.jsonl"
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"task": "arith", "id": p.id, "completion": f"\\boxed{{{p.answer}}}"}) + "\n")
            f.write(json.dumps({"task": "arith", "id": p.id, "completion": f"\\boxed{{{int(p.answer) + 1}}}"}) + "\n")
    result = runner.invoke(
        app,
        [
            "eval",
            "--backend",
            "replay",
            "--model",
            str(path),
            "--task",
            "arith",
            "--k",
            "2",
            "--limit",
            "5",
            "--out",
            str(tmp_path),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["tasks"]["arith"]
    assert (summary["avg_at_k"], summary["n_problems"], summary["n_samples"], summary["pass_at_k"]) == (0.5, 5, 10, 1.0)


def test_missing_samples_and_bad_rows_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task": "arith", "id": "test-0", "completion": "x"}\n{"task": "arith", "completion": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'id': missing"):
        read_replay_file(path)
    path.write_text('{"task": "arith", "id": "test-0", "completion": "x"}\n')
    result = runner.invoke(
        app, ["eval", "--backend", "replay", "--model", str(path), "--task", "arith", "--k", "2", "--limit", "1", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "has 1 sample(s) and no sample 1" in " ".join(result.output.split())


def test_grading_errors_are_counted_and_gate_the_exit_code(tmp_path):
    problems = ArithTask(ArithOptions()).load("test")[:3]
    path = tmp_path / "outputs.jsonl"
    completions = [f"\\boxed{{{problems[0].answer}}}", "\\boxed{9^{9^{9}}}", "no answer"]  # pass, grader blow-up, fail
    path.write_text("".join(json.dumps({"task": "arith", "id": p.id, "completion": c}) + "\n" for p, c in zip(problems, completions)))
    args = [
        "eval",
        "--backend",
        "replay",
        "--model",
        str(path),
        "--task",
        "arith",
        "--k",
        "1",
        "--limit",
        "3",
        "--out",
        str(tmp_path),
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "grading error rate above" in " ".join(result.output.split())
    summary = json.loads(result.stdout[: result.stdout.rindex("}") + 1])["tasks"]["arith"]
    assert (summary["n_pass"], summary["n_fail"], summary["n_errors"]) == (1, 1, 1)
    assert summary["avg_at_k"] == 0.5  # the errored sample is excluded, not scored as a fail
    assert runner.invoke(app, [*args, "--max-error-rate", "0.5"]).exit_code == 0


def test_task_args_reach_the_task(tmp_path):
    options = ArithOptions(max_operand=50, max_mul_operand=9)
    problems = ArithTask(options).load("test")[:4]
    path = tmp_path / "outputs.jsonl"
    path.write_text("".join(json.dumps({"task": "arith", "id": p.id, "completion": f"\\boxed{{{p.answer}}}"}) + "\n" for p in problems))
    base = [
        "eval",
        "--backend",
        "replay",
        "--model",
        str(path),
        "--task",
        "arith",
        "--k",
        "1",
        "--limit",
        "4",
        "--out",
        str(tmp_path),
        "--json",
    ]
    matched = runner.invoke(app, [*base, "--task-arg", "arith.max_operand=50", "--task-arg", "arith.max_mul_operand=9"])
    assert json.loads(matched.stdout)["tasks"]["arith"]["avg_at_k"] == 1.0
    default = runner.invoke(app, base)  # the default arith distribution has different problems under the same ids
    assert json.loads(default.stdout)["tasks"]["arith"]["avg_at_k"] < 1.0
    bad = runner.invoke(app, [*base, "--task-arg", "arith.bogus=1"])
    assert bad.exit_code == 2 and "task_args.arith.bogus" in bad.output


def test_replayed_turns_are_tokenised_by_table_and_cut_at_max_turn_chars():
    """Ids are the character tokenizer's, without its per-token objects (a 4 MB turn cost 1.5 GB and 25 s through it);
    a turn over max_turn_chars is cut there with finish reason length, like a model at its token limit."""
    from opd_harness.backends import SamplingParams
    from opd_harness.backends.replay import ReplayBackend

    text = "héllo\n\tw😀rld \x0b~"
    backend = ReplayBackend({("t", "1"): [[text, "x" * 50]]}, max_turn_chars=20)
    first, second = backend.generate([[0], [0]], SamplingParams(), keys=[("t", "1", 0, 0), ("t", "1", 0, 1)])
    assert first.token_ids == backend.tokenizer(text, add_special_tokens=False)["input_ids"] and first.finish_reason == "stop"
    assert (second.text, second.finish_reason, len(second.token_ids), len(second.logprobs)) == ("x" * 20, "length", 20, 20)
    with pytest.raises(ValueError, match="max_turn_chars"):
        ReplayBackend({}, max_turn_chars=0)
