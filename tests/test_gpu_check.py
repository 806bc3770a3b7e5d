"""benchmarks/gpu_check.sh in its CPU dry mode (what CI can run) and its refusal when pydantic cannot be provided."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run_script(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_dry_mode_runs_the_whole_check_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = run_script(["--dry-run", "--out", str(out)], PY=sys.executable, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DRY MODE (--dry-run): skipping every CUDA measurement" in done.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "dry" and report["device"] == "cpu" and report["failures"] == []
    assert list(report["models"]) == ["demo"]  # the wide pair is GPU-only
    demo = report["models"]["demo"]
    assert demo["generation"]["sequences"] == 4 * 2 and 0 < demo["generation"]["tokens"] <= 4 * 2 * 8
    assert demo["generation"]["tokens_per_s"] > 0 and demo["learner"]["step_s_mean"] > 0 and demo["teacher_score_s"] > 0
    assert demo["logprob_check"]["ok"] and demo["logprob_check"]["max_abs_diff"] == 0.0  # CPU against CPU in dry mode
    assert demo["student_parameters"] < demo["teacher_parameters"]
    assert report["vllm_tests"] == {"ran": False, "reason": "no CUDA (dry mode)"}
    # the shape sections run in the dry mode only with --dry-shapes; the end-to-end opd run always, on the smoke models
    assert list(report["sections"]) == ["opd_run:smoke"]
    run = report["sections"]["opd_run:smoke"]
    assert run["returncode"] == 0 and run["steps"] == run["expected_steps"] == 2, run
    assert {"trainer.device=cpu", "trainer.vocab_chunk=5"} <= set(run["command"])
    assert run["perf_mean"]["perf/learner_tokens_per_s"] > 0 and "perf/mfu/actor" not in run["perf_mean"]  # no MFU on a CPU
    ray = report["ray"]  # planned on the CPU (the layout of one GPU shared by three roles validated), and said not to have run
    assert ray["ran"] is False and ray["mode"] == "planned" and ray["returncode"] == 0, ray
    assert ray["planned_num_gpus"] == {"learner": 0.4, "rollout": 0.3, "teacher": 0.3} and sum(ray["planned_num_gpus"].values()) == 1
    assert "ray part: dry mode: the Ray part has NOT run on a GPU (planned only)" in done.stdout


def test_without_pydantic_or_wheels_it_stops_with_exit_2(tmp_path):
    no_site = tmp_path / "python-no-site"
    no_site.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # -S: no site-packages, so pydantic does not import
    no_site.chmod(0o755)
    done = run_script(["--out", str(tmp_path / "x.json")], PY=str(no_site), GPU_WHEELS=str(tmp_path / "empty"))
    assert done.returncode == 2
    assert "fetch-wheels" in done.stderr and not (tmp_path / "x.json").exists()


def test_the_ray_part_says_when_ray_is_missing_and_reports_a_failed_or_short_run(monkeypatch, capsys):
    gpu_check = load_gpu_check()

    original = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else original(name, *a))
    args = gpu_check.parse_args(["--out", "x.json"])
    assert gpu_check.ray_part(args, cuda=True, deadline=0.0) == {"ran": False, "skipped": "ray not installed"}
    assert "ray part skipped: ray not installed" in capsys.readouterr().out
    base = {"models": {}, "vllm_tests": {"ran": False}}
    assert gpu_check.check_failures({**base, "ray": {"ran": False, "skipped": "ray not installed"}}, 1e-4) == []
    short = {"ran": True, "steps": 2, "expected_steps": 4, "returncode": 0}
    assert gpu_check.check_failures({**base, "ray": short}, 1e-4) == ["ray: the run stored 2 of its 4 steps"]
    failed = {"ran": True, "returncode": 1, "error": "harness run --executor ray exited 1\nboom"}
    assert gpu_check.check_failures({**base, "ray": failed}, 1e-4) == ["ray: harness run --executor ray exited 1"]
    command = gpu_check.ray_command(4, "/tmp/o", plan_only=False)
    assert {"trainer.layout.learner.num_gpus=0.4", "trainer.layout.rollout.num_gpus=0.3", "trainer.layout.teacher.num_gpus=0.3",
            "trainer.steps=4", "--executor", "ray", "async"} <= set(command)  # fmt: skip


def test_every_failed_check_is_reported():
    gpu_check = load_gpu_check()
    report = {
        "models": {
            "demo": {"error": "Traceback (most recent call last):\nRuntimeError: CUDA error"},
            "wide": {"logprob_check": {"ok": False, "max_abs_diff": 3e-3}},
            "fine": {"logprob_check": {"ok": True, "max_abs_diff": 1e-6}},
        },
        "vllm_tests": {"ran": True, "ok": False, "returncode": 1},
    }
    failures = gpu_check.check_failures(report, 1e-4)
    assert failures[:2] == ["demo: raised RuntimeError: CUDA error", "wide: GPU vs CPU log-probs differ by 3.00e-03 > 0.0001"]
    assert len(failures) == 3 and failures[2].startswith("vLLM GPU tests failed")
    assert gpu_check.check_failures({"models": {"fine": report["models"]["fine"]}, "vllm_tests": {"ran": False}}, 1e-4) == []


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_bound_is_weights_plus_kv_over_bandwidth():
    from types import SimpleNamespace

    gpu_check = load_gpu_check()
    config = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, head_dim=128)  # Qwen3-0.6B
    bound = gpu_check.decode_bound(config, 600_000_000, batch=256, mean_context=640, bandwidth=4.8e12)
    kv = 2 * 28 * 8 * 128 * 2  # K and V, bf16: 114,688 bytes per token
    assert bound["kv_bytes_per_token"] == kv and bound["step_bytes"] == 1.2e9 + 256 * 640 * kv
    assert bound["tokens_per_s"] == pytest.approx(256 * 4.8e12 / (1.2e9 + 256 * 640 * kv))
    assert gpu_check.hbm_bandwidth("NVIDIA H200") == 4.8e12 and gpu_check.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_check.hbm_bandwidth("Some GPU") is None and "tokens_per_s" not in gpu_check.decode_bound(config, 1, 1, 1, None)


def test_shape_sections_report_errors_caps_and_logprob_gaps():
    gpu_check = load_gpu_check()
    report = {
        "models": {},
        "sections": {
            "rollout:a": {"batches": {"256": {"hf_static": {"logprob_vs_score_max_abs_diff": 0.3}}, "64": {"skipped": "cap"}}},
            "learner:a": {"timed_out": True, "cap_s": 50},
            "scoring:a": {"error": "Traceback\ntorch.OutOfMemoryError: CUDA out of memory"},
            "rollout:b": {"skipped": "budget"},
            "opd_run:a": {"returncode": 0, "steps": 7, "expected_steps": 10},
            "opd_run:b": {"returncode": 0, "steps": 10, "expected_steps": 10},
        },
        "vllm_tests": {"ran": False},
    }
    assert gpu_check.check_failures(report, 1e-4, 0.1) == [
        "rollout:a batch 256: hf_static log-probs differ from scoring by 0.300 > 0.1",
        "learner:a: killed at its cap of 50 s",
        "scoring:a: raised torch.OutOfMemoryError: CUDA out of memory",
        "opd_run:a: the run stored 7 of its 10 steps",
    ]


def test_the_serve_section_measures_three_engines_and_stops_at_its_deadline(monkeypatch):
    """The serve section (#25's client row on a GPU) on a tiny model on the CPU: every side's rounds, their means and the
    ratios to the old engine; past its deadline the rounds left are counted as skipped, not run."""
    import argparse
    import time

    from opd_harness.models.tiny import TinyArch, build_tiny_model

    gpu_check = load_gpu_check()

    def tiny_shape(arch, device, layers):
        tokenizer = gpu_check.shape_tokenizer(64)
        model = build_tiny_model(TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64), len(tokenizer),
                                 pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=0)  # fmt: skip
        model.config.vocab_size = len(tokenizer)
        return model.eval(), 1234

    monkeypatch.setattr(gpu_check, "shape_model", tiny_shape)
    args = argparse.Namespace(shape_layers=None, serve_clients=4, serve_tokens=6, serve_gap_ms=1.0, serve_rounds=2)
    out: dict = {}
    gpu_check.serve_section("qwen3-0.6b-shape", args, "cpu", out, time.monotonic() + 600)
    assert (out["parameters"], out["clients"], out["tokens"]) == (1234, 4, 6) and set(out["sides"]) == {"old", "new", "new_inline"}
    for side in out["sides"].values():
        assert len(side["tokens_per_s"]) == 2 and all(rate > 0 for rate in side["tokens_per_s"]) and "skipped_rounds" not in side
        assert side["tokens_per_s_mean"] == pytest.approx(sum(side["tokens_per_s"]) / 2)
    assert out["new_over_old"] == pytest.approx(out["sides"]["new"]["tokens_per_s_mean"] / out["sides"]["old"]["tokens_per_s_mean"])
    late: dict = {}
    gpu_check.serve_section("qwen3-0.6b-shape", args, "cpu", late, time.monotonic() - 1)
    assert all(side == {"tokens_per_s": [], "median_ttft_s": [], "skipped_rounds": 2} for side in late["sides"].values())
    assert "new_over_old" not in late
