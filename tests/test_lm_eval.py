"""The lm-eval bridge (``--task lm_eval:<name>``), the registry's prefix factories and chunked grading."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.registry import TASKS, Registry, RegistryError
from opd_harness.task import Problem, Score

pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "data" / "lm_eval"
ANSWERS = ["5", "3", "9", "14", "0", "20"]  # arith.jsonl, in order
runner = CliRunner()


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the datasets cache of the local json tasks out of the home directory."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture
def include(tmp_path) -> Path:
    """The test task YAMLs, with the absolute path of arith.jsonl filled in, plus their utils.py."""
    folder = tmp_path / "lm_eval_tasks"
    folder.mkdir()
    for template in DATA.glob("*.yaml.tmpl"):
        text = template.read_text().format(data_file=(DATA / "arith.jsonl").resolve())
        (folder / template.name.removesuffix(".tmpl")).write_text(text)
    shutil.copy(DATA / "utils.py", folder / "utils.py")
    return folder


def make(name: str, include: Path, **options):
    """The bridge task ``lm_eval:<name>`` built as ``harness eval`` builds it."""
    from opd_harness.plan import make_task

    return make_task(f"lm_eval:{name}", {f"lm_eval:{name}": {"include_path": str(include), **options}})


def lm_eval_contexts(include: Path, name: str, num_fewshot: int, **build) -> list[str]:
    """Contexts built by lm-eval itself, as its evaluator does (fresh TaskManager, seed 1234)."""
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(include), include_defaults=False).load(name)["tasks"][name]
    task.set_config(key="num_fewshot", value=num_fewshot)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(**build)
    return [inst.arguments[0] for inst in sorted(task.instances, key=lambda i: (i.doc_id, i.idx)) if inst.idx == 0]


def details(score: Score) -> dict:
    return json.loads(score.details)


# --------------------------------------------------------------------------- registry prefixes


def test_prefix_factory_builds_each_name_once_and_errors_stay_clear():
    reg: Registry = Registry("things")
    reg.add("plain", object())
    built = []
    reg.add_prefix("fam", lambda rest: built.append(rest) or f"made:{rest}")
    assert reg.get("fam:x") == "made:x" and reg.get("fam:x") == "made:x" and built == ["x"]
    assert "fam:y" in reg and "other:y" not in reg and "plain" in reg
    assert reg.names() == ["plain"]  # a family is not listed name by name
    with pytest.raises(RegistryError, match=r"unknown things 'other:y'.*Valid things: plain, fam:<name>"):
        reg.get("other:y")
    with pytest.raises(RegistryError, match="expected fam:<name> with a name after the colon"):
        reg.get("fam:")
    with pytest.raises(RegistryError, match="duplicate things prefix 'fam'"):
        reg.add_prefix("fam", lambda rest: rest)


def test_lm_eval_prefix_is_registered_without_importing_lm_eval():
    code = (
        "import sys; from opd_harness.registry import TASKS; TASKS.names(); "
        "assert 'lm_eval' in TASKS.prefixes(); assert 'lm_eval' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    cls = TASKS.get("lm_eval:anything")
    assert cls.name == "lm_eval:anything" and cls.lm_eval_name == "anything"


# --------------------------------------------------------------------------- loading, prompts, grading


def test_generate_until_problems_prompts_and_grading(include):
    task = make("arith_gen", include)
    problems = task.load()
    assert [p.id for p in problems] == ["0", "1", "2", "3", "4", "5"]
    assert [p.answer for p in problems] == ANSWERS
    assert problems[0].question == "Answer with a number.\n\nQ: What is 2+3?\nA:"
    assert task.format_prompt(problems[0], tokenizer=None) == problems[0].question
    assert task.options.max_new_tokens == 12 and task.until == ("\n", "Q:") and task.options.k == 1
    assert task.grader == ("lm_eval:exact_match", __import__("lm_eval").__version__)
    scores = task.grade_many(problems[:3], [" 5\nQ: What is 1+1?\nA: 2", " 4", "I think 9"])
    assert [s.status for s in scores] == ["pass", "fail", "pass"]
    assert scores[0].extracted == "5"  # cut at the first stop string, then the task's regex filter
    assert details(scores[0]) == {"filter": "number", "metric": "exact_match", "metrics": {"number": {"exact_match": 1.0}}}


def test_few_shot_contexts_match_lm_eval(include):
    task = make("arith_gen", include, num_fewshot=2)
    ours = [p.question for p in task.load()]
    assert ours == lm_eval_contexts(include, "arith_gen", 2)
    assert ours[0].count("Q: ") == 3 and ours[0].startswith("Answer with a number.\n\n")


def test_chat_template_contexts_match_lm_eval(include):
    from opd_harness.models.tiny import build_char_tokenizer
    from opd_harness.tasks.lm_eval_bridge import render_chat

    plain = build_char_tokenizer()
    task = make("arith_gen", include, apply_chat_template=True)
    problem = task.load()[0]
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        task.format_prompt(problem, plain)
    chat = build_char_tokenizer()
    chat.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    prompt = task.format_prompt(problem, chat)
    assert (
        prompt
        == lm_eval_contexts(include, "arith_gen", 0, apply_chat_template=True, chat_template=lambda m, **kw: render_chat(chat, m, **kw))[0]
    )
    assert prompt.startswith("<system>Answer with a number.") and prompt.endswith("<assistant>")


def test_scoring_exceptions_are_errors_and_non_binary_values_too(include):
    task = make("arith_custom", include)
    problems = task.load()
    scores = task.grade_many(problems[:4], ["5", "boom", "half", "nope"])
    assert [s.status for s in scores] == ["pass", "error", "error", "fail"]
    assert "process_results raised ValueError: scoring exploded" in details(scores[1])["reason"]
    assert "is 0.5, not 0/1" in details(scores[2])["reason"]
    assert details(scores[3])["metrics"] == {"none": {"correct": 0, "length": 4}}  # every metric is kept
    assert make("arith_custom", include, metric="length").grader[0] == "lm_eval:length"
    assert task.options.k == 2 and make("arith_custom", include, k=3).options.k == 3  # the task's repeats, unless set


def test_status_mapping_and_stop_truncation():
    from opd_harness.tasks.lm_eval_bridge import binary_status, truncate_at_stop

    assert [binary_status(v) for v in (1, 1.0, True, 0, 0.0, False)] == ["pass"] * 3 + ["fail"] * 3
    assert [binary_status(v) for v in (0.5, float("nan"), None, "1", (1, 0))] == ["error"] * 5
    assert truncate_at_stop(" 5\nQ: x", ("\n", "Q:")) == " 5" and truncate_at_stop("Q: 5", ("\n", "Q:")) == ""


def test_multiple_choice_and_loglikelihood_grade_the_chosen_answer(include):
    mc = make("arith_mc", include)
    problems = mc.load()
    assert problems[0].question == "Q: What is 2+3?\nA:" and problems[0].answer == "5"
    scores = mc.grade_many(problems[:3], ["5", "11", "not a choice"])
    assert [s.status for s in scores] == ["pass", "fail", "fail"]
    assert details(scores[0])["metrics"]["none"] == {"acc": 1.0, "acc_norm": 1.0}
    assert details(scores[2])["note"] == "completion is none of the 4 choices"
    ll = make("arith_ll", include)
    problems = ll.load()
    assert problems[0].answer == " 5"
    assert [s.status for s in ll.grade_many(problems[:2], [" 5", " 4"])] == ["pass", "fail"]


def test_bad_names_options_and_types_are_clear_errors(include, tmp_path):
    from opd_harness.config import ConfigError

    rolling = include / "arith_rolling.yaml"  # written before the include path is first indexed
    rolling.write_text(
        (include / "arith_ll.yaml")
        .read_text()
        .replace("arith_ll", "arith_rolling")
        .replace("output_type: loglikelihood", "output_type: loglikelihood_rolling")
        .replace("metric: acc", "metric: word_perplexity")
    )
    with pytest.raises(ConfigError, match=r"unknown lm-eval task 'arith_gn' in include path .*Did you mean 'arith_gen'"):
        make("arith_gn", include)
    with pytest.raises(ConfigError, match="fixes num_fewshot: 0"):
        make("arith_custom", include, num_fewshot=1)
    with pytest.raises(ConfigError, match=r"no metric 'f1'; it has: exact_match"):
        make("arith_gen", include, metric="f1")
    with pytest.raises(
        ConfigError, match="is a group or tag of 2 tasks; evaluate them one by one: --task lm_eval:arith_gen, lm_eval:arith_mc"
    ):
        make("arith_tasks", include)
    with pytest.raises(ConfigError, match="not a directory"):
        make("arith_gen", tmp_path / "missing")
    with pytest.raises(ConfigError, match="'arith_rolling' has output_type 'loglikelihood_rolling', which the bridge does not support"):
        make("arith_rolling", include)


# --------------------------------------------------------------------------- harness eval end to end


def eval_cli(*args: str):
    return runner.invoke(app, ["eval", *args])


def test_eval_replay_writes_rows_and_json(include, tmp_path):
    replay = tmp_path / "outputs.jsonl"
    completions = [f" {a}\nQ: next" if i % 2 == 0 else " 1000" for i, a in enumerate(ANSWERS)]
    replay.write_text(
        "".join(json.dumps({"task": "lm_eval:arith_gen", "id": str(i), "completion": c}) + "\n" for i, c in enumerate(completions))
    )
    out = tmp_path / "results"
    result = eval_cli(
        "--backend",
        "replay",
        "--model",
        str(replay),
        "--task",
        "lm_eval:arith_gen",
        "--task-arg",
        f"lm_eval:arith_gen.include_path={include}",
        "--k",
        "1",
        "--out",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["tasks"]["lm_eval:arith_gen"]
    assert (summary["n_pass"], summary["n_fail"], summary["n_errors"], summary["avg_at_k"]) == (3, 3, 0, 0.5)
    assert summary["grader"].startswith("lm_eval:exact_match/")
    with sqlite3.connect(out / "results.sqlite") as db:
        rows = db.execute(
            "SELECT problem_id, status, extracted FROM samples WHERE task = 'lm_eval:arith_gen' ORDER BY CAST(problem_id AS INT)"
        ).fetchall()
    assert rows == [(str(i), "pass" if i % 2 == 0 else "fail", a if i % 2 == 0 else "1000") for i, a in enumerate(ANSWERS)]


def test_eval_error_rate_gate_and_unknown_task(include, tmp_path):
    replay = tmp_path / "outputs.jsonl"
    replay.write_text(
        "".join(
            json.dumps({"task": "lm_eval:arith_custom", "id": str(i), "completion": c}) + "\n" for i, c in enumerate(["5", "boom", "9"])
        )
    )
    base = ["--backend", "replay", "--model", str(replay), "--k", "1", "--limit", "3", "--out", str(tmp_path / "r")]
    result = eval_cli(*base, "--task", "lm_eval:arith_custom", "--task-arg", f"lm_eval:arith_custom.include_path={include}", "--json")
    assert result.exit_code == 1 and "grading error rate above" in " ".join(result.output.split())
    result = eval_cli(*base, "--task", "lm_eval:nope", "--task-arg", f"lm_eval:nope.include_path={include}")
    assert result.exit_code == 2
    assert "unknown lm-eval task 'nope'" in " ".join(result.output.split())


@pytest.fixture
def tiny_model_dir(tmp_path, char_tokenizer, tiny_model_factory) -> Path:
    from opd_harness.models.tiny import save_model_and_tokenizer

    path = tmp_path / "tiny"
    save_model_and_tokenizer(tiny_model_factory(seed=1), char_tokenizer, path)
    return path


def test_eval_hf_generation_stops_at_the_task_stop_strings(include, tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    args = [
        "--model",
        str(tiny_model_dir),
        "--task",
        "lm_eval:arith_gen",
        "--task-arg",
        f"lm_eval:arith_gen.include_path={include}",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--k",
        "2",
        "--out",
        str(out),
        "--json",
    ]
    result = eval_cli(*args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["tasks"]["lm_eval:arith_gen"]
    assert summary["n_samples"] == 12 and summary["n_errors"] == 0
    with sqlite3.connect(out / "results.sqlite") as db:
        rows = db.execute("SELECT completion, details FROM samples").fetchall()
    for completion, detail in rows:
        for stop in ("\n", "Q:"):  # the backend stops at the first stop string (kept at the end)
            assert stop not in completion[: len(completion) - len(stop)]
        assert json.loads(detail)["filter"] == "number"


def test_eval_hf_multiple_choice_picks_the_argmax_loglikelihood(include, tiny_model_dir, tmp_path):
    from opd_harness.models.tiny import load_model_and_tokenizer

    out = tmp_path / "results"
    result = eval_cli(
        "--model",
        str(tiny_model_dir),
        "--task",
        "lm_eval:arith_mc",
        "--task-arg",
        f"lm_eval:arith_mc.include_path={include}",
        "--out",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["tasks"]["lm_eval:arith_mc"]
    assert summary["n_samples"] == 6 and summary["n_errors"] == 0 and summary["grader"].startswith("lm_eval:acc/")
    with sqlite3.connect(out / "results.sqlite") as db:
        rows = dict(db.execute("SELECT problem_id, completion FROM samples").fetchall())
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    docs = [json.loads(line) for line in (DATA / "arith.jsonl").read_text().splitlines()]
    for i, doc in enumerate(docs):  # recompute each choice's log-likelihood with the model directly
        context = f"Q: {doc['question']}\nA:"
        lls = []
        for choice in doc["choices"]:
            ctx_ids = tok(context, add_special_tokens=False)["input_ids"]
            ids = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = F.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
            lls.append(sum(logp[t - 1, ids[t]].item() for t in range(len(ctx_ids), len(ids))))
        assert rows[str(i)] == doc["choices"][max(range(len(lls)), key=lambda j: (lls[j], -j))]


# --------------------------------------------------------------------------- chunked grading with a progress bar


class CountingTask:
    """A task whose grade depends only on each (problem, completion): pass when the completion is the answer."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def grade_many(self, problems, completions):
        self.calls.append(len(completions))
        return [Score("pass" if c == p.answer else "fail", c) for p, c in zip(problems, completions)]

    def grade_trajectories(self, problems, trajectories):
        return self.grade_many(problems, [t.completion_text for t in trajectories])


def test_grading_in_chunks_gives_the_same_scores():
    from opd_harness.evaluation import grade_episodes
    from opd_harness.trajectory import Segment, Trajectory

    problems = [Problem(id=str(i), question="q", answer=str(i % 3)) for i in range(10)]
    completions = [str(i % 2) for i in range(10)]
    episodes = [Trajectory("counting", p.id, 0, [], segments=[Segment("model", [1], c, step=0)]) for p, c in zip(problems, completions)]
    whole = CountingTask().grade_many(problems, completions)
    task = CountingTask()
    assert grade_episodes(task, problems, episodes, chunk=4, show_progress=True) == whole
    assert task.calls == [4, 4, 2]
    assert all("grade_s" in t.timings for t in episodes)
    with pytest.raises(ValueError, match="10 problems but 9 trajectories"):
        grade_episodes(task, problems, episodes[:9])
