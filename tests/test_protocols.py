"""Issue #43, items 2, 4 and 6: top-k sampling, evaluation protocols (--protocol, --print-config, explicit flags over the
protocol, the protocol in the store and on the leaderboard, --output-path files equal to the store), and paper-scale
recipes that name their layout (reproduce --dry-run on a CPU host)."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
import yaml
from typer.testing import CliRunner

from opd_harness.backends import SamplingParams
from opd_harness.backends.hf import HFBackend
from opd_harness.backends.sampling import draw, draw_rows, nucleus_probs
from opd_harness.cli import app
from opd_harness.leaderboard import leaderboard_rows, render_csv, render_markdown
from opd_harness.store import SCHEMA, Store
from opd_harness.tasks.synthetic.arith import ArithOptions, ArithTask

runner = CliRunner()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- top-k sampling


def test_top_k_keeps_the_k_most_likely_tokens_renormalised():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    probs = nucleus_probs(logits, 1.0, 1.0, top_k=2)
    assert (probs[0, [0, 2, 4]] == 0).all() and probs[0, [1, 3]].sum().item() == pytest.approx(1.0)
    assert probs[0, 1] / probs[0, 3] == pytest.approx(torch.e, rel=1e-5)  # the kept tokens keep their ratio


def test_top_k_row_draws_do_not_depend_on_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    batched = [torch.Generator().manual_seed(s) for s in range(4)]
    single = [torch.Generator().manual_seed(s) for s in range(4)]
    for _ in range(20):
        tokens, valid = draw_rows(logits, 1.5, 0.9, batched, top_k=3)
        assert valid.all()
        assert tokens.tolist() == [int(draw(row, 1.5, 0.9, g, 3)) for row, g in zip(logits, single, strict=True)]


def test_hf_top_k_samples_only_the_k_most_likely_tokens(char_tokenizer, tiny_model_factory):
    """At temperature 2 a random tiny model spreads its mass; with top_k 2 every sampled token is one of the step's two
    most likely (Completion.top_ids holds them, from the untempered distribution)."""
    backend = HFBackend(tiny_model_factory(seed=3), char_tokenizer, batch_size=8)
    prompts = [encode(char_tokenizer, "Compute 1+2.\n"), encode(char_tokenizer, "xy")]
    params = SamplingParams(temperature=2.0, top_k=2, top_logprobs=2, max_new_tokens=12, n=8, seed=1)
    completions = backend.generate(prompts, params)
    steps = [(token, top) for c in completions for token, top in zip(c.token_ids, c.top_ids, strict=True)]
    assert len(steps) > 50 and all(token in top for token, top in steps)
    untouched = backend.generate(prompts, params.model_copy(update={"top_k": 0}))
    assert any(token not in top for c in untouched for token, top in zip(c.token_ids, c.top_ids, strict=True))


def test_hf_top_k_sampling_of_a_row_is_independent_of_its_batch(char_tokenizer, tiny_model_factory):
    backend = HFBackend(tiny_model_factory(seed=3), char_tokenizer, batch_size=8)
    a, b = encode(char_tokenizer, "Compute 1+2.\n"), encode(char_tokenizer, "xy")
    params = SamplingParams(temperature=1.3, top_k=4, top_p=0.95, max_new_tokens=10, n=3, seed=0)
    together = backend.generate([a, b], params.model_copy(update={"seeds": (11, 12)}))
    alone = backend.generate([a], params.model_copy(update={"seeds": (11,)}))
    assert [c.token_ids for c in together[:3]] == [c.token_ids for c in alone]


def test_hf_refuses_a_presence_penalty(char_tokenizer, tiny_model_factory):
    backend = HFBackend(tiny_model_factory(seed=3), char_tokenizer)
    with pytest.raises(ValueError, match="presence penalty"):
        backend.generate([encode(char_tokenizer, "x")], SamplingParams(presence_penalty=1.5, max_new_tokens=2))


# --------------------------------------------------------------------------- protocols


def print_config(*args: str) -> dict:
    result = runner.invoke(app, ["eval", "--model", "Qwen/Qwen3-1.7B", "--print-config", *args])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


def test_protocol_sets_sampling_tokens_k_and_thinking_per_task_family():
    printed = print_config("--task", "math500,aime24", "--protocol", "qwen3-thinking")
    assert printed["protocol"] == "qwen3-thinking"
    math500, aime24 = printed["tasks"]["math500"], printed["tasks"]["aime24"]
    for task in (math500, aime24):
        assert (task["temperature"], task["top_p"], task["top_k"], task["enable_thinking"]) == (0.6, 0.95, 20, True)
    assert (aime24["max_new_tokens"], aime24["k"]) == (38912, 64)  # the competition family's rule (the task declares it)
    assert (math500["max_new_tokens"], math500["k"]) == (32768, 4)  # the report states no k: the task's own
    greedy = print_config("--task", "math500", "--protocol", "greedy")["tasks"]["math500"]
    assert (greedy["temperature"], greedy["k"], greedy["max_new_tokens"]) == (0.0, 1, 4096)


def test_explicit_flags_override_the_protocol():
    task = print_config("--task", "aime24", "--protocol", "qwen3-thinking", "--temperature", "1.0", "--top-k", "5", "--k", "2",
                        "--max-new-tokens", "100", "--no-enable-thinking")["tasks"]["aime24"]  # fmt: skip
    assert (task["temperature"], task["top_p"], task["top_k"], task["k"], task["max_new_tokens"], task["enable_thinking"]) == (
        1.0, 0.95, 5, 2, 100, False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--protocol", "nope"], "--protocol 'nope': unknown"),
        (["--protocol", "qwen3-non-thinking"], "presence penalty 1.5, which the HFBackend backend cannot apply"),
    ],
)
def test_bad_protocols_exit_2_in_one_line(args, message):
    result = runner.invoke(app, ["eval", "--model", "x", "--task", "aime24", "--print-config", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_non_thinking_protocol_without_the_penalty_on_hf_is_an_explicit_choice():
    task = print_config("--task", "aime24", "--protocol", "qwen3-non-thinking", "--presence-penalty", "0")["tasks"]["aime24"]
    assert (task["temperature"], task["top_p"], task["presence_penalty"], task["k"]) == (0.7, 0.8, 0.0, 64)


def test_output_path_files_equal_the_store_and_the_leaderboard_shows_the_protocol(tmp_path):
    problems = ArithTask(ArithOptions()).load("test")[:3]
    answers = [f"\\boxed{{{p.answer}}}" for p in problems[:2]] + ["\\boxed{-1}"]
    model = tmp_path / "outputs.jsonl"
    model.write_text("".join(json.dumps({"task": "arith", "id": p.id, "completion": a}) + "\n" for p, a in zip(problems, answers)))
    out, files = tmp_path / "results", tmp_path / "lm-eval"
    result = runner.invoke(app, ["eval", "--backend", "replay", "--model", str(model), "--task", "arith", "--limit", "3",
                                 "--protocol", "greedy", "--out", str(out), "--output-path", str(files), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    run_id = json.loads(result.stdout)["run_id"]
    store = Store(out)
    (row,) = store.evals(run_id)
    (results_file,) = files.glob("results_*.json")
    (samples_file,) = files.glob("samples_arith_*.jsonl")
    results = json.loads(results_file.read_text())
    assert results["protocol"] == "greedy" and results["config"]["settings"]["arith"]["k"] == 1
    summary = results["results"]["arith"]
    assert (summary["avg_at_k"], summary["ci_low"], summary["ci_high"], summary["k"], summary["n_problems"]) == (
        row["avg_at_k"], row["ci_low"], row["ci_high"], row["k"], row["n_problems"])  # fmt: skip
    assert summary["avg_at_k"] == pytest.approx(2 / 3)
    lines = [json.loads(line) for line in samples_file.read_text().splitlines()]
    stored = store.samples(run_id, 0, "arith")
    assert [(s["problem_id"], s["sample_index"], s["score"], s["status"]) for s in lines] == [
        (s["problem_id"], s["sample_index"], s["score"], s["status"]) for s in stored]  # fmt: skip
    assert sum(s["score"] for s in lines) / len(lines) == pytest.approx(row["avg_at_k"])
    rows = leaderboard_rows(store, [run_id])
    assert rows[0]["protocol"] == "greedy"
    assert "| greedy |" in render_markdown(rows) and render_csv(rows).splitlines()[1].endswith(",greedy")
    board = runner.invoke(app, ["leaderboard", str(out), "--format", "json"])
    assert json.loads(board.stdout)[0]["protocol"] == "greedy"


def test_a_store_written_before_the_protocol_column_still_reads(tmp_path):
    conn = sqlite3.connect(tmp_path / "results.sqlite")
    conn.executescript(SCHEMA)  # the runs table without the protocol column
    conn.execute("INSERT INTO runs VALUES ('old', 'eval', NULL, 'arith', 'm', 'done', '{}', 1.0, 1.0)")
    conn.execute("INSERT INTO evals (run_id, step, task, k, n, n_problems, avg_at_k, ci_low, ci_high, pass_at_k, n_errors, grader, "
                 "grader_version, created_at) VALUES ('old', 0, 'arith', 1, 2, 2, 0.5, 0.0, 1.0, 0.5, 0, 'g', '1', 1.0)")  # fmt: skip
    conn.commit()
    conn.close()
    rows = leaderboard_rows(Store(tmp_path))
    assert rows[0]["avg_at_k"] == 0.5 and rows[0]["protocol"] is None and "| - |" in render_markdown(rows)


# --------------------------------------------------------------------------- paper-scale recipes


def test_reproduce_paper_dry_run_shows_layout_device_and_precision_on_a_cpu_host(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, ["reproduce", "sod", "--scale", "paper", "--dry-run"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "layout: docs/layouts/sod-8xh100.yaml" in text and 'trainer.precision: "bf16"' in text
    placement = "layout (executor ray): rollout 1 × (4 GPU, 8 CPU); teacher 2 × (1 GPU, 4 CPU); learner 2 × (1 GPU, 4 CPU)"
    assert f"{placement}: 8 GPUs in all" in text
    # one plan per student and method: sod (its four weight/GRPO arms x 5 seeds share one) and grpo
    assert "## plan 1 of 4: run [0]" in text and "and 19 more run(s)" in text and text.count("memory plan (GiB") == 4
    assert "dry run: every check passed" in text


def test_every_paper_scale_names_a_shipped_layout():
    from opd_harness.reproduce import RECIPES, layout_placement, load_recipe

    for name, _ in RECIPES.items():
        paper = load_recipe(name).scales["paper"]
        placement = layout_placement(paper.layout)
        assert paper.layout_source and {"trainer.precision", "trainer.layout", "trainer.executor"} <= set(placement), name


def test_run_sampling_flags_equal_their_set_keys():
    flags = runner.invoke(app, ["run", "--preset", "smoke", "--temperature", "0.7", "--top-p", "0.9", "--print-config"])
    keys = runner.invoke(app, ["run", "--preset", "smoke", "--set", "trainer.temperature=0.7", "--set", "trainer.top_p=0.9",
                               "--print-config"])  # fmt: skip
    assert flags.exit_code == keys.exit_code == 0 and flags.stdout == keys.stdout
    assert yaml.safe_load(flags.stdout)["trainer"]["temperature"] == 0.7
    thinking = runner.invoke(app, ["run", "--preset", "smoke", "--enable-thinking", "--print-config"])
    assert thinking.exit_code == 2 and "trainer.enable_thinking" in thinking.output  # a tiny model has no chat template


def test_vllm_gets_top_k_and_presence_penalty_only_when_on():
    from opd_harness.backends.vllm_backend import sampling_kwargs
    from tests.fake_vllm import FakeSamplingParams

    on = sampling_kwargs(SamplingParams(temperature=0.6, top_k=20, presence_penalty=1.5), 0)
    off = sampling_kwargs(SamplingParams(temperature=0.6), 0)
    assert (on["top_k"], on["presence_penalty"]) == (20, 1.5) and "top_k" not in off and "presence_penalty" not in off
    assert FakeSamplingParams(**on)["top_k"] == 20


def test_openai_sends_top_k_as_an_extra_body_field_only_when_on(char_tokenizer):
    from opd_harness.backends.openai_backend import OpenAIBackend

    backend = OpenAIBackend(object(), "m", char_tokenizer, server_extensions=False)
    on = backend._common_kwargs(0, SamplingParams(temperature=0.6, top_k=20, presence_penalty=1.5))
    assert on["extra_body"] == {"top_k": 20} and on["presence_penalty"] == 1.5
    assert "extra_body" not in backend._common_kwargs(0, SamplingParams(temperature=0.6))
    assert "extra_body" not in backend._common_kwargs(0, SamplingParams(temperature=0.0, top_k=20))  # greedy: nothing to cut
