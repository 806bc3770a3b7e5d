"""The headline command (issue 43): models and trainer settings as flags equal to their --set keys, `--dry-run` checking
data, models, the teacher–student pair and the teacher's log-probs, `harness eval`'s device/dtype flags, and a hub id
refused at once offline. Tiny models saved to folders stand for real ones."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.models.tiny import CHARSET, TinyArch, build_char_tokenizer, build_tiny_model, save_model_and_tokenizer

runner = CliRunner()
SMALL = ["--set", "task_args.arith.n_train=200", "--set", "task_args.arith.n_test=4"]


def save(folder: Path, tokenizer, *, seed: int, hidden: int = 32) -> str:
    arch = TinyArch(hidden=hidden, layers=1, heads=2, kv_heads=1, ffn=2 * hidden, max_positions=128)
    model = build_tiny_model(arch, len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=seed)
    save_model_and_tokenizer(model, tokenizer, folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    other_eos = build_char_tokenizer()
    other_eos.eos_token = "<unk>"
    return {
        "student": save(root / "student", build_char_tokenizer(), seed=1),
        "teacher": save(root / "teacher", build_char_tokenizer(), seed=2, hidden=64),
        "other_tokenizer": save(root / "other_tokenizer", build_char_tokenizer(CHARSET[::-1]), seed=3),  # other ids
        "other_eos": save(root / "other_eos", other_eos, seed=4),
    }


def dry_run(models: dict[str, str], teacher: str = "teacher", *extra: str):
    args = ["run", "--method", "f_opd", "--task", "arith", "--student", models["student"], "--teacher", models[teacher], *SMALL]
    return runner.invoke(app, [*args, *extra, "--dry-run"])


def one_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def test_dry_run_of_a_named_pair_passes_and_prints_the_plan(models):
    result = dry_run(models)
    assert result.exit_code == 0, result.output
    for shown in ("data: arith [train] 200 problems", "student: ", "teacher: ", "method f_opd (async)", "pair: same token ids",
                  "memory plan", "every check passed"):  # fmt: skip
        assert shown in result.output, (shown, result.output)


@pytest.mark.parametrize(
    "teacher, says",
    [("other_tokenizer", "the teacher's tokenizer differs from the student's: token"), ("other_eos", "the teacher's EOS token '<unk>'")],
)
def test_dry_run_refuses_a_teacher_that_cannot_score_the_student_s_tokens(models, teacher, says):
    result = dry_run(models, teacher)
    assert result.exit_code == 2 and says in one_line(result.output), result.output


def test_dry_run_names_missing_data_and_the_data_dir_flag(models, tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    args = ["run", "--task", "math500", "--student", models["student"], "--teacher", models["teacher"], "--data-dir", str(empty)]
    result = runner.invoke(app, [*args, "--set", "task_args.math500.source=local", "--dry-run"])
    assert result.exit_code == 2 and "--data-dir" in result.output and "math500" in result.output, result.output


class NoLogprobs(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that lists one model and answers completions without log-probs."""

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._send({"object": "list", "data": [{"id": "teacher", "object": "model", "created": 0, "owned_by": "me"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
        self._send({"id": "x", "object": "text_completion", "created": 0, "model": "teacher", "choices": [choice]})

    def log_message(self, *args) -> None:
        pass


def test_dry_run_probes_a_served_teacher_and_refuses_one_without_log_probs(models):
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoLogprobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        args = ["run", "--method", "opd", "--task", "arith", "--student", models["student"], *SMALL]
        result = runner.invoke(app, [*args, "--set", "teacher.backend=openai", "--set", f"teacher.base_url={url}", "--dry-run"])
    finally:
        server.shutdown()
    assert result.exit_code == 2 and "the served teacher did not return the log-probs" in one_line(result.output), result.output


def test_run_flags_equal_their_set_keys(models, tmp_path):
    """A 2-step run with the flags resolves the same config and trains the same losses as with the --set keys."""
    from opd_harness.store import Store

    common = ["--method", "opd", "--task", "arith", *SMALL, "--set", "trainer.prompts_per_step=2", "--set", "trainer.checkpoint_every=2",
              "--set", "eval.before_training=false", "--set", "eval.teacher=false", "--set", "eval.limit=2", "--set", "eval.k=1",
              "--set", "eval.n_resamples=100", "--set", "threads=1"]  # fmt: skip
    flags = ["--student", models["student"], "--teacher", models["teacher"], "--steps", "2", "--lr", "0.01", "--device", "cpu",
             "--dtype", "fp32"]  # fmt: skip
    sets = [f"student.path={models['student']}", f"teacher.path={models['teacher']}", "trainer.steps=2", "trainer.lr=0.01",
            "trainer.device=cpu", "trainer.precision=fp32"]  # fmt: skip
    sets = [a for s in sets for a in ("--set", s)]
    printed = [runner.invoke(app, ["run", *common, *way, "--print-config"]) for way in (flags, sets)]
    assert printed[0].exit_code == printed[1].exit_code == 0, printed[0].output + printed[1].output
    assert yaml.safe_load(printed[0].stdout) == yaml.safe_load(printed[1].stdout)
    losses = []
    for i, way in enumerate((flags, sets)):
        out = tmp_path / f"out{i}"
        result = runner.invoke(app, ["run", *common, *way, "--out", str(out)])
        assert result.exit_code == 0, result.output
        store = Store(out)
        (run,) = [r for r in store.runs() if r["kind"] == "train"]
        losses.append({step: metrics["loss"] for step, metrics in store.step_metrics(run["run_id"]).items()})
    assert sorted(losses[0]) == [1, 2] and losses[0] == losses[1]


def test_dtype_fp16_is_refused_for_training_in_one_line(models):
    result = dry_run(models, "teacher", "--dtype", "fp16")
    assert result.exit_code == 2 and "float16 training needs loss scaling" in one_line(result.output)


def test_eval_takes_device_and_dtype_flags(models, tmp_path):
    args = ["eval", "--model", models["student"], "--task", "arith", "--task-arg", "arith.n_test=4", "--limit", "2", "--k", "1"]
    result = runner.invoke(app, [*args, "--device", "cpu", "--dtype", "bf16", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tasks"]["arith"]["n_samples"] == 2


def test_gate_takes_the_same_device_and_dtype_flags_as_eval(models, tmp_path):
    """``harness gate``'s --device/--dtype become the evaluated model path's backend options, the same ones
    ``--backend-option device=... dtype=...`` gives (so the second gate reuses the first one's evaluation)."""
    from opd_harness.store import Store

    args = ["gate", "--baseline", models["student"], "--candidate", models["student"], "--task", "arith", "--task-arg",
            "arith.n_test=4", "--limit", "2", "--k", "1", "--out", str(tmp_path), "--json"]  # fmt: skip
    flagged = runner.invoke(app, [*args, "--device", "cpu", "--dtype", "bfloat16"])
    assert flagged.exit_code == 3, flagged.output  # 2 problems: too few to decide, but both sides were evaluated
    with Store(tmp_path) as store:
        (run,) = store.runs()
        assert store.get_run(run["run_id"])["config"]["backend_options"] == {"device": "cpu", "dtype": "bf16"}
    as_options = runner.invoke(app, [*args, "--backend-option", "device=cpu", "--backend-option", "dtype=bf16"])
    assert as_options.exit_code == 3 and "reused its evaluation" in as_options.stdout, as_options.output
    with Store(tmp_path) as store:
        assert len(store.runs()) == 1


@pytest.mark.parametrize(
    "flags, says", [(["--device", "cuda"], "torch sees no CUDA device here"), (["--dtype", "float8"], "'float8': choose one of")]
)
@pytest.mark.parametrize("command", ["eval", "gate"])
def test_eval_refuses_a_device_or_dtype_it_cannot_use_in_one_line(models, tmp_path, flags, says, command):
    """The same refusal from ``harness eval`` and from ``harness gate`` on a model path (the flags are shared)."""
    import torch

    if flags[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    model = ["--model", models["student"]] if command == "eval" else ["--baseline", models["student"], "--candidate", models["student"]]
    result = runner.invoke(app, [command, *model, "--task", "arith", "--limit", "2", *flags, "--out", str(tmp_path)])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert flags[0] in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "results.sqlite").exists()


def test_eval_refuses_a_model_folder_without_weights_in_one_line(models, tmp_path):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text((Path(models["student"]) / "config.json").read_text())
    result = runner.invoke(app, ["eval", "--model", str(folder), "--task", "arith", "--limit", "2", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "the folder has no weights" in one_line(result.output)


@pytest.mark.parametrize("command", ["eval", "run"])
def test_an_uncached_hub_id_fails_within_seconds_offline(monkeypatch, tmp_path, models, command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    if command == "eval":
        args = ["eval", "--model", "nobody/no-such-model", "--task", "arith", "--limit", "1", "--out", str(tmp_path / "out")]
    else:
        args = ["run", "--student", "nobody/no-such-model", "--teacher", models["teacher"], *SMALL, "--out", str(tmp_path / "out")]
    started = time.perf_counter()
    result = runner.invoke(app, args)
    assert time.perf_counter() - started < 10
    assert result.exit_code == 2 and "the hub is offline (HF_HUB_OFFLINE)" in one_line(result.output)
    assert "pass --" in result.output and not (tmp_path / "out").exists()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("opd-harness ")
