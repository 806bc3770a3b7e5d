"""lm-evaluation-harness's own API client (``local-completions``) against `harness serve`.

lm-eval sends log-likelihood requests as ``echo: true``, ``max_tokens: 1``, ``logprobs: 1`` with
token-id prompts and generation requests with ``stop``; both run here on a tiny model, and the
results equal the in-process ``hf`` backend's on the same tasks.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from serving import metrics, running
from typer.testing import CliRunner

from opd_harness.backends.hf import HFBackend
from opd_harness.cli import app
from opd_harness.models.tiny import load_model_and_tokenizer, save_model_and_tokenizer
from opd_harness.serve import make_app

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="lm-eval's API models need tenacity (the lmeval extra pins it)")
from test_lm_eval import datasets_cache, include  # noqa: E402,F401 - the same task folder and datasets cache

DATA = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture
def model_dir(tmp_path, char_tokenizer, tiny_model_factory) -> Path:
    path = tmp_path / "tiny"
    save_model_and_tokenizer(tiny_model_factory(seed=1), char_tokenizer, path)
    return path


def in_process(model_dir: Path, include_path: Path, task: str, out: Path) -> tuple[dict, dict[str, str]]:
    """``harness eval`` with the in-process hf backend: the task summary and each doc's completion."""
    args = [
        "eval",
        "--model",
        str(model_dir),
        "--task",
        f"lm_eval:{task}",
        "--task-arg",
        f"lm_eval:{task}.include_path={include_path}",
        "--temperature",
        "0",
        "--out",
        str(out),
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    with sqlite3.connect(out / "results.sqlite") as db:
        completions = dict(db.execute("SELECT problem_id, completion FROM samples").fetchall())
    return json.loads(result.stdout)["tasks"][f"lm_eval:{task}"], completions


@pytest.mark.slow
def test_lm_eval_local_completions_against_harness_serve(model_dir, include, tmp_path):  # noqa: F811 - the fixture imported above
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm, tok = load_model_and_tokenizer(model_dir)
    with running(make_app(HFBackend(lm, tok), model_name="tiny", max_batch=8)) as base:
        model_args = {
            "model": "tiny",
            "base_url": f"{base}/v1/completions",
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
            "num_concurrent": 3,  # concurrent requests: the server batches them
            "max_retries": 1,
            "max_length": 128,
        }
        results = simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["arith_mc", "arith_gen"],
            task_manager=TaskManager(include_path=str(include), include_defaults=False),
            log_samples=True,
        )
        stats = metrics(base)
    assert stats["harness_serve_batch_size_max"] > 1  # concurrent clients shared batches

    # multiple choice: lm-eval's choice log-likelihoods (echo + logprobs) are the model's, and its
    # accuracy equals the in-process hf backend's on the same task
    docs = [json.loads(line) for line in (DATA / "arith.jsonl").read_text().splitlines()]
    samples = sorted(results["samples"]["arith_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for sample, doc in zip(samples, docs, strict=True):
        context = tok(f"Q: {doc['question']}\nA:", add_special_tokens=False)["input_ids"]
        for (ll, _greedy), choice in zip((r[0] for r in sample["resps"]), doc["choices"], strict=True):
            ids = tok(f"Q: {doc['question']}\nA: {choice}", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(lm(torch.tensor([ids])).logits[0, :-1], dim=-1)
            assert ll == pytest.approx(sum(logp[t - 1, ids[t]].item() for t in range(len(context), len(ids))), abs=1e-4)
    summary, _ = in_process(model_dir, include, "arith_mc", tmp_path / "mc")
    assert results["results"]["arith_mc"]["acc,none"] == pytest.approx(summary["avg_at_k"])

    # generate_until: greedy through the server gives the in-process backend's completions (cut at the stops)
    summary, completions = in_process(model_dir, include, "arith_gen", tmp_path / "gen")
    served = {str(s["doc_id"]): s["resps"][0][0] for s in results["samples"]["arith_gen"]}
    assert served.keys() == completions.keys()
    for doc_id, completion in completions.items():
        cut = min([completion.find(stop) for stop in ("\n", "Q:") if stop in completion], default=len(completion))
        assert served[doc_id] == completion[:cut]
    assert results["results"]["arith_gen"]["exact_match,number"] == pytest.approx(summary["avg_at_k"])
