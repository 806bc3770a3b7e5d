"""`harness serve` in a subprocess + `harness eval --backend openai` against it: the CLI round trip."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, save_model_and_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_then_eval_with_openai_backend(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(
        TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64), len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0
    )
    model_dir = tmp_path / "model"
    save_model_and_tokenizer(model, tok, model_dir)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "opd_harness.cli", "serve", "--model", str(model_dir), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
                    assert json.load(r)["data"][0]["id"] == str(model_dir)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()
                time.sleep(0.2)
        result = subprocess.run(
            [sys.executable, "-m", "opd_harness.cli", "eval", "--backend", "openai", "--model", str(model_dir), "--task", "arith",
             "--k", "2", "--limit", "3", "--out", str(tmp_path / "out"), "--json", "--backend-option", f"base_url=http://127.0.0.1:{port}/v1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)["tasks"]["arith"]
        assert summary["n_samples"] == 6 and summary["n_errors"] == 0  # a random model fails, but every sample is graded
    finally:
        server.terminate()
        server.wait(timeout=10)


BAD_FLAGS = [
    ("--max-batch", "0"),
    ("--max-batch-tokens", "0"),
    ("--max-logprobs", "-2"),
    ("--max-model-len", "0"),
    ("--max-request-sequences", "0"),
    ("--max-request-tokens", "0"),
    ("--max-queued-sequences", "1000"),  # fewer than --max-request-sequences (1024)
    ("--max-body-bytes", "0"),
]


@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS)
def test_bad_serve_flags_exit_2_naming_the_flag(tmp_path, flag, value):
    from typer.testing import CliRunner

    from opd_harness.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "missing"), flag, value])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and f"{flag} must be" in output  # refused before the model is loaded
