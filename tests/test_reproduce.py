"""`harness reproduce`: every recipe plans at both scales; claims give the verdict the numbers give on synthetic stores
(holds / does not hold / inconclusive); a two-run few-step version of the f-OPD recipe runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.reproduce import (
    RECIPES,
    ClaimSpec,
    RecipeError,
    evaluate_claim,
    load_recipe,
    parse_recipe,
    plan_text,
    run_recipe,
    scale_sweep,
    sweep_runs,
)
from opd_harness.store import SampleRow, Store

runner = CliRunner()
BUILT_INS = ("f-opd", "sod", "saf-opd", "ap-opd")


def test_the_four_papers_are_registered():
    assert set(BUILT_INS) <= set(RECIPES.names())


@pytest.mark.parametrize("name", BUILT_INS)
@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_every_recipe_plans_at_both_scales(name, scale):
    """Every run of the scale validates and plans (config + plan_run); the plan lists runs, sources, resources and claims."""
    recipe = load_recipe(name)
    text = plan_text(recipe, scale, scale_sweep(recipe, scale))
    n_runs = int(text.split("runs (", 1)[1].split(")", 1)[0])
    assert n_runs >= 2 and f"[{n_runs - 1}]" in text
    assert "resources:" in text and all(c.id in text for c in recipe.claims)
    assert "warning:" not in text  # every table row, plot row and claim side selects at least one planned run
    if scale == "paper":
        assert "sources:" in text


def test_dry_run_on_the_command_line_and_bad_names_exit_2(tmp_path):
    result = runner.invoke(app, ["reproduce", "ap-opd", "--scale", "cpu", "--dry-run", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "ap-opd (cpu scale)" in result.stdout and not (tmp_path / "results.sqlite").exists()
    bad = runner.invoke(app, ["reproduce", "f-opdd", "--dry-run"])
    assert bad.exit_code == 2 and "Did you mean 'f-opd'" in bad.output
    assert runner.invoke(app, ["reproduce", "f-opd", "--scale", "huge", "--dry-run"]).exit_code == 2


def test_a_selection_that_matches_no_run_is_reported():
    data = yaml.safe_load(Path(RECIPES.get("ap-opd")).read_text())
    data["claims"][0]["candidate"] = {"method": "ap_opdd"}
    recipe = parse_recipe(data, "ap-opd")
    assert "warning: claim ap-opd-beats-opd candidate matches no run" in plan_text(recipe, "cpu", scale_sweep(recipe, "cpu"))


def test_a_paper_value_without_a_source_is_refused():
    data = yaml.safe_load(Path(RECIPES.get("ap-opd")).read_text())
    del data["scales"]["paper"]["sources"]["trainer.lr"]
    with pytest.raises(RecipeError, match=r"no source for \['trainer.lr'\]"):
        parse_recipe(data, "ap-opd")


# ---- claims on synthetic stores -----------------------------------------------------------------


def _add_run(store: Store, run_id: str, method: str, seed: int, scores: np.ndarray, *, per_hour: float | None = None,
             entropy: float | None = None) -> None:  # fmt: skip
    """A done run whose last evaluation (step 10, task arith) has these (problems, k) scores (NaN = errored)."""
    store.create_run(run_id, kind="train", config={"method": method, "seed": seed, "task": "arith"}, method=method, task="arith")
    store.set_status(run_id, "done")
    n, k = scores.shape
    rows = [
        SampleRow(f"p{i}", j, "", None, 0.0 if np.isnan(s) else float(s), "error" if np.isnan(s) else "pass" if s else "fail", 0.0)
        for i in range(n) for j, s in enumerate(scores[i])
    ]  # fmt: skip
    summary = {"k": k, "n_samples": n * k, "n_problems": n, "avg_at_k": float(np.nanmean(scores)), "ci_low": 0.0, "ci_high": 1.0}
    store.add_eval(run_id, 10, "arith", summary, rows, grader="g", grader_version="1")
    if per_hour is not None:
        store.add_checkpoint(run_id, 10, path=None, samples_seen=int(per_hour), train_seconds=3600.0)
    if entropy is not None:
        for step in range(1, 11):
            store.log_step(run_id, step, {"student_entropy": entropy})


def _claims_store(tmp_path: Path, gap: float, *, seeds: int = 3, n: int = 200, k: int = 4, rng_seed: int = 0) -> list:
    """Methods a and b on the same problems; a's pass probability is b's + gap."""
    rng = np.random.default_rng(rng_seed)
    p = rng.uniform(0.2, 0.8, n)
    with Store(tmp_path) as store:
        for s in range(seeds):
            _add_run(store, f"a{s}", "a", s, (rng.random((n, k)) < np.clip(p + gap, 0, 1)[:, None]).astype(float))
            _add_run(store, f"b{s}", "b", s, (rng.random((n, k)) < p[:, None]).astype(float))
        record = {"points": [{"run_id": f"{m}{s}"} for m in "ab" for s in range(seeds)]}
        return sweep_runs(store, record)


def _claim(**kw) -> ClaimSpec:
    return ClaimSpec(**{"id": "c", "text": "a > b", "metric": "final_avg", "candidate": {"method": "a"}, "baseline": {"method": "b"},
                        "op": ">", **kw})  # fmt: skip


@pytest.mark.parametrize(("gap", "verdict"), [(0.15, "holds"), (-0.15, "does not hold"), (0.0, "inconclusive")])
def test_final_avg_claim_gives_the_verdict_the_numbers_give(tmp_path, gap, verdict):
    runs = _claims_store(tmp_path, gap)
    with Store(tmp_path) as store:
        result = evaluate_claim(store, runs, _claim(), n_resamples=2000)
    assert result.verdict == verdict, result
    assert result.n_seeds == 3 and result.n_problems == 200
    assert result.delta == pytest.approx(gap, abs=0.05)
    assert result.ci_low <= result.delta <= result.ci_high


def test_non_inferiority_margin_and_errored_samples(tmp_path):
    """a 0.03 below b: 'a >= b - 0.1' holds, 'a >= b' does not; errored candidate samples count against it."""
    runs = _claims_store(tmp_path, -0.03, n=400)
    with Store(tmp_path) as store:
        assert evaluate_claim(store, runs, _claim(op=">=", margin=0.1), n_resamples=2000).verdict == "holds"
        assert evaluate_claim(store, runs, _claim(op=">=", margin=0.0), n_resamples=2000).verdict == "does not hold"
    (tmp_path / "e").mkdir()
    with Store(tmp_path / "e") as store:  # equal sides, but 30% of the candidate's samples errored: not a pass for it
        rng = np.random.default_rng(1)
        for s in range(3):
            scores = (rng.random((200, 4)) < 0.5).astype(float)
            bad = scores.copy()
            bad[rng.random(bad.shape) < 0.3] = np.nan
            _add_run(store, f"a{s}", "a", s, bad)
            _add_run(store, f"b{s}", "b", s, scores)
        runs = sweep_runs(store, {"points": [{"run_id": f"{m}{s}"} for m in "ab" for s in range(3)]})
        result = evaluate_claim(store, runs, _claim(op=">=", margin=0.05), n_resamples=2000)
    assert result.verdict == "inconclusive" and result.ci_low < -0.05 < result.ci_high


def test_too_few_seeds_is_inconclusive_whatever_the_gap(tmp_path):
    runs = _claims_store(tmp_path, 0.3, seeds=1)
    with Store(tmp_path) as store:
        result = evaluate_claim(store, runs, _claim(), n_resamples=500)
    assert result.verdict == "inconclusive" and "1 paired seed" in result.reasons[0]


@pytest.mark.parametrize(("seeds", "faster", "verdict"), [(5, True, "holds"), (5, False, "does not hold"), (3, True, "inconclusive")])
def test_scalar_claims_use_the_exact_sign_test_over_seeds(tmp_path, seeds, faster, verdict):
    """Throughput: 5 seeds all one way reach p = 1/32 < 0.05; 3 seeds cannot (p >= 1/8), whatever the gap."""
    with Store(tmp_path) as store:
        for s in range(seeds):
            one = np.ones((4, 1))
            _add_run(store, f"a{s}", "a", s, one, per_hour=2000.0 + s if faster else 900.0, entropy=0.5)
            _add_run(store, f"b{s}", "b", s, one, per_hour=1000.0 + s, entropy=0.2)
        runs = sweep_runs(store, {"points": [{"run_id": f"{m}{s}"} for m in "ab" for s in range(seeds)]})
        result = evaluate_claim(store, runs, _claim(metric="samples_per_hour"))
        entropy = evaluate_claim(store, runs, _claim(metric="step_metric", step_metric="student_entropy", window=5))
        floor = evaluate_claim(store, runs, _claim(metric="step_metric", step_metric="student_entropy", baseline=None, value=0.6))
    assert result.verdict == verdict and result.test == "exact sign test over seeds"
    assert entropy.verdict == ("holds" if seeds == 5 else "inconclusive") and entropy.delta == pytest.approx(0.3)
    assert floor.verdict == ("does not hold" if seeds == 5 else "inconclusive") and floor.baseline == pytest.approx(0.6)


# ---- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_run_f_opd_recipe_runs_end_to_end_and_resumes(tmp_path):
    """f-OPD's recipe with its CPU grid cut to sync vs async OPD, one seed, 4 smoke steps: the sweep runs, the tables,
    plots and every claim render (inconclusive on one seed); a second call skips the done runs."""
    data = yaml.safe_load(Path(RECIPES.get("f-opd")).read_text())
    data["scales"]["cpu"]["sweep"] = {
        "base": {"preset": "smoke", "set": {"eval.teacher": False, "threads": 1}},
        "grid": {"method": ["opd"], "trainer.mode": ["sync", "async"], "seed": [0]},
    }
    recipe = parse_recipe(data, "f-opd")
    result = run_recipe(recipe, "cpu", tmp_path, n_resamples=200)
    assert not result.failed
    md = result.markdown
    assert "2 of 2 runs done" in md and "Throughput x final/peak Avg@k" in md and "| opd | sync |" in md
    assert [c.verdict for c in result.claims] == ["inconclusive"] * len(recipe.claims)
    assert "0 of 5 claims held" in md
    assert result.plots and all(p.stat().st_size > 0 for p in result.plots)
    claims = json.loads((result.folder / "claims.json").read_text())
    assert [c["id"] for c in claims] == [c.id for c in recipe.claims]
    again = run_recipe(recipe, "cpu", tmp_path, n_resamples=200)
    assert again.markdown == md


def test_render_writes_tables_plots_claims_and_the_leaderboard_section(tmp_path):
    """render() reads only the store: per-task and step-metric tables, a plot, the claims; the HTML page shows them."""
    from opd_harness.leaderboard_page import load_board, render_html

    _claims_store(tmp_path, 0.2, seeds=2)
    with Store(tmp_path) as store:
        for run_id in ("a0", "a1", "b0", "b1"):
            for step in range(1, 6):
                store.log_step(run_id, step, {"student_entropy": 0.4 if run_id[0] == "a" else 0.1})
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    points = [{"run_id": f"{m}{s}", "coords": {"method": m, "seed": s}} for m in "ab" for s in range(2)]
    (sweeps / "toy-cpu.json").write_text(json.dumps({"sweep_id": "toy-cpu", "grid_keys": ["method", "seed"], "points": points}))
    rows = [{"label": "A", "where": {"method": "a"}}, {"label": "B", "where": {"method": "b"}}]
    recipe = parse_recipe({
        "paper": {"title": "Toy"},
        "scales": {"cpu": {"sweep": {"grid": {"method": ["a", "b"]}}}},
        "tables": [{"kind": "per_task", "title": "Per task", "tasks": ["arith"], "groups": {"math": ["arith"]}, "rows": rows},
                   {"kind": "step_metrics", "title": "Diagnostics", "metrics": ["student_entropy"], "window": 3, "rows": rows}],
        "plots": [{"kind": "step_metric", "metric": "student_entropy", "title": "entropy", "rows": rows}],
        "claims": [{"id": "a-wins", "text": "a > b", "metric": "final_avg", "candidate": {"method": "a"}, "baseline": {"method": "b"},
                    "op": ">"}],
    }, "toy")  # fmt: skip
    from opd_harness.reproduce import render

    result = render(recipe, "cpu", tmp_path, n_resamples=1000)
    md = result.markdown
    assert "4 of 4 runs done" in md and "| A | 2 |" in md and "| B | 2 | 0.400 ± 0.000 |" not in md
    assert "| B | 2 | 0.100 ± 0.000 |" in md  # the entropy table: mean of the last 3 steps over 2 seeds
    assert [c.verdict for c in result.claims] == ["holds"] and "1 of 1 claims held (a-wins)" in md
    assert (result.folder / "report.md").read_text() == md and result.plots[0].exists()
    page = render_html(load_board([tmp_path]))
    assert "Paper reproductions" in page and "toy-cpu" in page and "<b>holds</b>" in page
