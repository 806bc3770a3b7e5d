"""`harness reproduce`: every recipe plans at both scales and its claims compare one thing (arms whose resolved configs
differ only in the declared keys); claims give the verdict the numbers give on synthetic stores (holds / does not hold /
inconclusive), or "not resolvable at this scale" when the design cannot detect the paper's effect; a two-run few-step
version of the f-OPD recipe runs end to end."""

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
    Resolvability,
    check_claims,
    evaluate_claim,
    load_recipe,
    parse_recipe,
    plan_text,
    run_recipe,
    scale_sweep,
    sweep_runs,
    with_resolvability,
)
from opd_harness.sweep import expand
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
    points = expand(scale_sweep(recipe, scale))
    check_claims(recipe, scale, points)  # every claim's arms differ only in the keys it declares, in the full resolved configs
    text = plan_text(recipe, scale, scale_sweep(recipe, scale), points)
    n_runs = int(text.split("runs (", 1)[1].split(")", 1)[0])
    assert n_runs >= 2 and f"[{n_runs - 1}]" in text
    assert "resources:" in text and all(f"  {c.id}: " in text for c in recipe.claims)
    assert text.count("smallest detectable effect") == len(recipe.claims) and text.count("    assumes: alpha") == len(recipe.claims)
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
    data["claims"][0]["candidate"]["where"] = {"method": "ap_opdd"}
    recipe = parse_recipe(data, "ap-opd")
    assert "warning: claim ap-opd-beats-opd arm 'AP-OPD' matches no run" in plan_text(recipe, "cpu", scale_sweep(recipe, "cpu"))


def test_a_paper_value_without_a_source_is_refused():
    data = yaml.safe_load(Path(RECIPES.get("ap-opd")).read_text())
    del data["scales"]["paper"]["sources"]["trainer.lr"]
    with pytest.raises(RecipeError, match=r"no source for \['trainer.lr'\]"):
        parse_recipe(data, "ap-opd")


# ---- claims on synthetic stores -----------------------------------------------------------------


def _add_run(store: Store, run_id: str, method: str, seed: int, scores: np.ndarray, *, per_hour: float | None = None,
             entropy: float | None = None) -> None:  # fmt: skip
    """A done run whose last evaluation (step 10, task arith) has these (problems, k) scores (NaN = errored)."""
    config = {"method": method, "seed": seed, "task": "arith", "eval": {"tasks": ["arith"]}, "trainer": {"mode": "sync"}}
    store.create_run(run_id, kind="train", config=config, method=method, task="arith")
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


def _claims_store(tmp_path: Path, gap: float | list[float], *, seeds: int = 3, n: int = 200, k: int = 4, rng_seed: int = 0) -> list:
    """Methods a and b on the same problems; a's pass probability is b's + gap (a list: one gap per seed)."""
    rng = np.random.default_rng(rng_seed)
    p = rng.uniform(0.2, 0.8, n)
    gaps = gap if isinstance(gap, list) else [gap] * seeds
    with Store(tmp_path) as store:
        for s in range(seeds):
            _add_run(store, f"a{s}", "a", s, (rng.random((n, k)) < np.clip(p + gaps[s], 0, 1)[:, None]).astype(float))
            _add_run(store, f"b{s}", "b", s, (rng.random((n, k)) < p[:, None]).astype(float))
        record = {"points": [{"run_id": f"{m}{s}"} for m in "ab" for s in range(seeds)]}
        return sweep_runs(store, record)


def _claim(**kw) -> ClaimSpec:
    return ClaimSpec(**{"id": "c", "text": "a > b", "metric": "final_avg", "candidate": {"name": "A", "where": {"method": "a"}},
                        "baseline": {"name": "B", "where": {"method": "b"}}, "differ_in": ["method"], "op": ">", **kw})  # fmt: skip


@pytest.mark.parametrize(("gap", "verdict"), [(0.15, "holds"), (-0.15, "does not hold"), (0.0, "inconclusive")])
def test_final_avg_claim_gives_the_verdict_the_numbers_give(tmp_path, gap, verdict):
    runs = _claims_store(tmp_path, gap)
    with Store(tmp_path) as store:
        result = evaluate_claim(store, runs, _claim())
    assert result.verdict == verdict, result
    assert result.n_seeds == 3 and result.n_problems == 200
    assert result.delta == pytest.approx(gap, abs=0.05)
    assert result.ci_low <= result.delta <= result.ci_high


def test_non_inferiority_margin_and_errored_samples(tmp_path):
    """a 0.03 below b on 5 seeds: 'a >= b - 0.1' holds, 'a >= b' does not; errored candidate samples count against it."""
    runs = _claims_store(tmp_path, -0.03, seeds=5, n=400)
    with Store(tmp_path) as store:
        assert evaluate_claim(store, runs, _claim(op=">=", margin=0.1)).verdict == "holds"
        assert evaluate_claim(store, runs, _claim(op=">=", margin=0.0)).verdict == "does not hold"
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
        result = evaluate_claim(store, runs, _claim(op=">=", margin=0.05))
    assert result.verdict == "inconclusive" and result.ci_low < -0.05 < result.ci_high


def test_a_gap_that_flips_between_seeds_is_no_held_claim(tmp_path):
    """Each seed's difference is clear on 400 problems x 4 (SE ~0.02), but five training seeds disagree (+0.10, +0.10,
    -0.06, -0.08, +0.10): their mean, +0.03, is no evidence about training runs, so the claim is inconclusive. A
    bootstrap of problems within the fixed seeds (the test before 2026-12-08) reads the same numbers as held."""
    from opd_harness.gate import bootstrap_deltas

    gaps = [0.10, 0.10, -0.06, -0.08, 0.10]
    runs = _claims_store(tmp_path, gaps, seeds=5, n=400)
    with Store(tmp_path) as store:
        result = evaluate_claim(store, runs, _claim())
        pairs = [(store.samples(f"a{s}", 10, "arith"), store.samples(f"b{s}", 10, "arith")) for s in range(5)]
    assert result.verdict == "inconclusive" and result.test == "paired t-test over seeds" and result.n_seeds == 5
    assert result.delta == pytest.approx(np.mean(gaps), abs=0.02) and result.ci_low < 0 < result.delta
    per_problem = [[np.array([x["score"] for x in arm]).reshape(400, 4).mean(axis=1) for arm in pair] for pair in pairs]
    within = [a - b for a, b in per_problem]
    assert np.mean(bootstrap_deltas(within, 2000, 0) <= 0) < 0.05  # the within-seed bootstrap would have said "holds"


def test_too_few_seeds_is_inconclusive_whatever_the_gap(tmp_path):
    runs = _claims_store(tmp_path, 0.3, seeds=1)
    with Store(tmp_path) as store:
        result = evaluate_claim(store, runs, _claim())
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
        floor = evaluate_claim(store, runs, _claim(metric="step_metric", step_metric="student_entropy", baseline=None, value=0.6,
                                                   differ_in=[]))  # fmt: skip
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
    result = run_recipe(recipe, "cpu", tmp_path)
    assert not result.failed
    md = result.markdown
    assert "2 of 2 runs done" in md and "Throughput x final/peak Avg@k" in md and "| opd | sync |" in md
    # one seed: async-faster's sign test cannot reach p < 0.05, so the design labels it; the claims whose arms this cut grid
    # lacks are inconclusive (no paired seeds)
    assert {c.id: c.verdict for c in result.claims} == {
        **{c.id: "inconclusive" for c in recipe.claims}, "async-faster": "not resolvable at this scale (needs ~5 seeds)"}
    assert "0 of 5 claims held" in md and "1 not resolvable at this scale (async-faster)" in md
    assert result.plots and all(p.stat().st_size > 0 for p in result.plots)
    claims = json.loads((result.folder / "claims.json").read_text())
    assert [c["id"] for c in claims] == [c.id for c in recipe.claims]
    again = run_recipe(recipe, "cpu", tmp_path)
    assert again.markdown == md


def test_render_writes_tables_plots_claims_and_the_leaderboard_section(tmp_path):
    """render() reads only the store: per-task and step-metric tables, a plot, the claims; the HTML page shows them."""
    from opd_harness.leaderboard_page import load_board, render_html

    _claims_store(tmp_path, 0.2, seeds=2)
    with Store(tmp_path) as store:
        for s in range(2):  # a third method, in no claim: a reference row
            _add_run(store, f"c{s}", "c", s, np.ones((10, 4)))
        for run_id in ("a0", "a1", "b0", "b1"):
            for step in range(1, 6):
                store.log_step(run_id, step, {"student_entropy": 0.4 if run_id[0] == "a" else 0.1})
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    points = [{"run_id": f"{m}{s}", "coords": {"method": m, "seed": s}} for m in "abc" for s in range(2)]
    (sweeps / "toy-cpu.json").write_text(json.dumps({"sweep_id": "toy-cpu", "grid_keys": ["method", "seed"], "points": points}))
    rows = [{"label": "A", "where": {"method": "a"}}, {"label": "B", "where": {"method": "b"}}, {"label": "C", "where": {"method": "c"}}]
    claim = {"id": "a-wins", "text": "a > b", "metric": "final_avg", "candidate": {"name": "A", "where": {"method": "a"}},
             "baseline": {"name": "B", "where": {"method": "b"}}, "differ_in": ["method"], "op": ">"}
    recipe = parse_recipe({
        "paper": {"title": "Toy"},
        "scales": {"cpu": {"sweep": {"grid": {"method": ["a", "b", "c"]}}}},
        "tables": [{"kind": "sweep", "title": "Sweep"},
                   {"kind": "per_task", "title": "Per task", "tasks": ["arith"], "groups": {"math": ["arith"]}, "rows": rows},
                   {"kind": "step_metrics", "title": "Diagnostics", "metrics": ["student_entropy"], "window": 3, "rows": rows}],
        "plots": [{"kind": "step_metric", "metric": "student_entropy", "title": "entropy", "rows": rows}],
        "claims": [claim, {**claim, "id": "a-wins-small"}],
    }, "toy")  # fmt: skip
    from opd_harness.reproduce import render

    unresolvable = Resolvability("a-wins-small", "cpu", "paired mean", 0.05, 0.8, 2, 0.03, "prior", 0.05, 0.001, 0.0, False, 1400,
                                 "not resolvable at this scale (needs ~1400 seeds)", "synthetic")  # fmt: skip
    result = render(recipe, "cpu", tmp_path, designs={"a-wins-small": unresolvable})
    md = result.markdown
    assert "6 of 6 runs done" in md and "| A | a-wins: A; a-wins-small: A | 2 |" in md and "| B | 2 | 0.400 ± 0.000 |" not in md
    assert "| B | a-wins: B; a-wins-small: B | 2 | 0.100 ± 0.000 |" in md  # the entropy table: mean of the last 3 steps over 2 seeds
    assert "| C | reference (not in a claim) | 2 | 1.000 ± 0.000 |" in md  # a row no claim reads is labelled
    assert "| c | 2/2 |" not in md and "| reference (not in a claim) |" in md.split("### Per task")[0]  # the sweep table's role column
    # the same numbers: the resolvable claim holds; the one its design cannot resolve is reported with that label only
    assert [c.verdict for c in result.claims] == ["holds", "not resolvable at this scale (needs ~1400 seeds)"]
    assert "the test alone reads 'holds'" in md and "1 not resolvable at this scale (a-wins-small)" in md
    assert "1 of 2 claims held (a-wins)" in md
    assert (result.folder / "report.md").read_text() == md and result.plots[0].exists()
    page = render_html(load_board([tmp_path]))
    assert "Paper reproductions" in page and "toy-cpu" in page and "<b>holds</b>" in page


# ---- a claim compares one thing -------------------------------------------------------------------


def _sod_recipe_with(grid: list[dict]) -> dict:
    data = yaml.safe_load(Path(RECIPES.get("sod")).read_text())
    data["scales"]["cpu"]["sweep"]["grid"] = grid
    return data


def test_a_claim_whose_arms_differ_in_an_undeclared_key_is_refused(tmp_path, monkeypatch):
    """SOD vs its uniform-weight baseline, but the baseline's runs also take another learning rate: the claim declares
    only method_args.sod.weights, so `harness reproduce` refuses it (exit 2, one line naming the claim and the key)."""
    data = _sod_recipe_with([
        {"method_args.sod.weights": ["adaptive"], "method_args.sod.grpo_coef": [1.0], "seed": [0, 1]},
        {"method_args.sod.weights": ["uniform"], "method_args.sod.grpo_coef": [1.0], "trainer.lr": [1.0e-3], "seed": [0, 1]},
    ])  # fmt: skip
    data["claims"] = data["claims"][:1]
    recipe = parse_recipe(data, "sod")
    with pytest.raises(RecipeError, match=r"claim sod-beats-opd: arms 'SOD' and 'OPD \(L_GRPO \+ L_OPD\)' also differ in "
                                          r"trainer.lr 0.0003 vs 0.001 \(differ_in: method_args.sod.weights\)") as refused:  # fmt: skip
        run_recipe(recipe, "cpu", tmp_path, dry_run=True)
    assert "\n" not in str(refused.value)  # one line
    path = tmp_path / "sod-lr.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    RECIPES.names()  # load the built-ins, then add this one for the test only
    monkeypatch.setitem(RECIPES._items, "sod-lr", path)
    result = runner.invoke(app, ["reproduce", "sod-lr", "--scale", "cpu", "--dry-run", "--out", str(tmp_path)])
    output = " ".join(result.output.split())  # the console wraps long lines
    assert result.exit_code == 2 and "claim sod-beats-opd" in output and "trainer.lr 0.0003 vs 0.001" in output
    # declared, the same difference passes
    data["claims"][0]["differ_in"] = ["method_args.sod.weights", "trainer.lr"]
    check_claims(parse_recipe(data, "sod"), "cpu", expand(scale_sweep(parse_recipe(data, "sod"), "cpu")))


def test_the_check_diffs_resolved_configs_not_overrides():
    """Two methods whose recipe overrides differ only in `method`, but whose resolved configs also differ in the pipeline
    (f-OPD's default mode is async, OPD's sync): a claim declaring only the method keys is refused."""
    data = yaml.safe_load(Path(RECIPES.get("f-opd")).read_text())
    data["scales"]["cpu"]["sweep"] = {"base": {"preset": "smoke", "set": {"eval.teacher": False}},
                                      "grid": {"method": ["opd", "f_opd"], "seed": [0]}}  # fmt: skip
    data["claims"] = [{"id": "x", "text": "f-OPD > OPD", "metric": "final_avg", "op": ">",
                       "candidate": {"name": "f-OPD", "where": {"method": "f_opd"}},
                       "baseline": {"name": "OPD", "where": {"method": "opd"}},
                       "differ_in": ["method", "method_args.opd", "method_args.f_opd"]}]  # fmt: skip
    recipe = parse_recipe(data, "f-opd")
    with pytest.raises(RecipeError, match=r'claim x: .* also differ in .*trainer.mode "async" vs "sync"'):
        check_claims(recipe, "cpu", expand(scale_sweep(recipe, "cpu")))


def test_an_arm_that_selects_two_configs_of_one_seed_is_refused():
    data = _sod_recipe_with([{"method_args.sod.weights": ["adaptive", "uniform"], "method_args.sod.grpo_coef": [1.0, 0.0], "seed": [0]}])
    data["claims"][0]["candidate"]["where"] = {"method": "sod", "method_args.sod.weights": "adaptive"}
    recipe = parse_recipe(data, "sod")
    with pytest.raises(RecipeError, match=r"arm 'SOD' selects 2 runs of seed 0 that differ in method_args.sod.grpo_coef; narrow its where"):
        check_claims(recipe, "cpu", expand(scale_sweep(recipe, "cpu")))


def test_a_claim_must_name_what_its_arms_may_differ_in():
    data = yaml.safe_load(Path(RECIPES.get("sod")).read_text())
    del data["claims"][0]["differ_in"]
    with pytest.raises(RecipeError, match="differ_in: name the keys"):
        parse_recipe(data, "sod")
    data = yaml.safe_load(Path(RECIPES.get("sod")).read_text())
    data["claims"][0]["candidate"] = {"method": "sod"}  # the former schema: an arm is {name, where}
    with pytest.raises(RecipeError, match="claims.0.candidate"):
        parse_recipe(data, "sod")


# ---- resolvability ---------------------------------------------------------------------------------


def _points(seeds: int, methods=("opd", "grpo"), limit: int = 100, k: int = 4) -> list:
    """Planned runs (configs only) of two arms over ``seeds`` seeds, each evaluated on ``limit`` problems x ``k``."""
    from types import SimpleNamespace

    from opd_harness.config import RunConfig

    return [SimpleNamespace(config=RunConfig.model_validate({"method": m, "seed": s, "eval": {"limit": limit, "k": k}}))
            for m in methods for s in range(seeds)]  # fmt: skip


Z95, Z80 = 1.6448536269514722, 0.8416212335729143  # one-sided 5 % and 80 % power quantiles of the standard normal


def simulated_t_test_power(effect: float, sd: float, seeds: int, alpha: float = 0.05, trials: int = 40_000) -> float:
    """How often the one-sided paired t-test over ``seeds`` normal differences (mean ``effect``, SD ``sd``) rejects."""
    from scipy.stats import t as student_t

    d = np.random.default_rng(0).normal(effect, sd, (trials, seeds))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / np.sqrt(seeds))
    return float(np.mean(t > student_t.ppf(1 - alpha, seeds - 1)))


@pytest.mark.parametrize("seeds", [3, 5, 10])
def test_the_smallest_detectable_effect_is_detected_with_the_stated_power(seeds):
    """At the MDE the simulated t-test rejects 80 % of the time (40,000 trials: +-0.6 % at 3 SE); the normal
    approximation's smaller effect is detected less often, most visibly with few seeds."""
    from opd_harness import power

    mde = power.mde_paired_mean(0.03, seeds, 0.05, 0.8)
    assert simulated_t_test_power(mde, 0.03, seeds) == pytest.approx(0.80, abs=0.006)
    normal = (Z95 + Z80) * 0.03 / np.sqrt(seeds)
    assert normal < mde and simulated_t_test_power(normal, 0.03, seeds) < 0.78
    assert power.mde_paired_mean(0.03, 1, 0.05, 0.8) == float("inf")


def test_a_large_effect_with_many_seeds_is_resolvable():
    from opd_harness import power
    from opd_harness.reproduce import resolvability

    claim = _claim(candidate={"name": "A", "where": {"method": "opd"}}, baseline={"name": "B", "where": {"method": "grpo"}},
                   effect={"baseline": 0.30, "candidate": 0.40, "source": "synthetic", "scaling": "absolute"},
                   design={"cpu": {"level": 0.30, "sd": 0.03, "source": "synthetic prior"}})  # fmt: skip
    r = resolvability(claim, "cpu", _points(10))
    floor = np.sqrt((0.3 * 0.7 + 0.4 * 0.6) / 400)  # two arms at 0.3 and 0.4, 100 problems x 4 samples
    assert r.seeds == 10 and r.sd == pytest.approx(max(0.03, floor))
    assert r.mde == pytest.approx(power.mde_paired_mean(r.sd, 10, 0.05, 0.8)) and r.expected == pytest.approx(0.10)
    assert (Z95 + Z80) * r.sd / np.sqrt(10) < r.mde < 1.1 * (Z95 + Z80) * r.sd / np.sqrt(10)  # t, close to normal at 10 seeds
    assert r.resolvable is True and r.label.startswith("resolvable")


def test_the_ap_opd_effect_with_three_seeds_is_not_resolvable():
    """AP-OPD's published gain (+1.8 % relative, Table 1) at the miniature's level 0.062 is +0.001 absolute; with the
    3-seed design and the measured per-seed SD 0.0146 it needs on the order of a thousand seeds."""
    from scipy import stats

    from opd_harness.reproduce import resolvability

    claim = _claim(candidate={"name": "A", "where": {"method": "opd"}}, baseline={"name": "B", "where": {"method": "grpo"}},
                   effect={"baseline": 0.3182, "candidate": 0.3239, "source": "AP-OPD Table 1"},
                   design={"cpu": {"level": 0.062, "sd": 0.0146, "source": "measured"}})  # fmt: skip
    r = resolvability(claim, "cpu", _points(3))
    assert r.expected == pytest.approx(0.062 * (0.3239 / 0.3182 - 1)) and 0.001 < r.expected < 0.003
    assert r.mde > 10 * r.expected and r.resolvable is False
    needed = r.seeds_needed  # the first count whose t-test power reaches 0.8 (noncentral t, computed here with scipy)
    noncentral = [stats.nct.sf(stats.t.ppf(0.95, n - 1), n - 1, r.expected / r.sd * np.sqrt(n)) for n in (needed - 1, needed)]
    assert noncentral[0] < 0.8 <= noncentral[1]
    assert needed >= int(np.ceil(((Z95 + Z80) * r.sd / r.expected) ** 2)) > 500  # never fewer than the normal approximation
    assert r.label == f"not resolvable at this scale (needs ~{needed} seeds)"


def test_the_shipped_ap_opd_claims_are_labelled_not_resolvable_in_the_dry_run():
    recipe = load_recipe("ap-opd")
    text = plan_text(recipe, "cpu", scale_sweep(recipe, "cpu"))
    assert text.count("-> not resolvable at this scale (needs ~") == 3


def test_sign_test_power_against_hand_computed_cases():
    from opd_harness import power

    assert power.sign_test_critical(4, 0.05) is None and power.sign_test_critical(5, 0.05) == 5  # 1/32 < 0.05 < 6/32
    assert power.sign_test_power(5, 0.9, 0.05) == pytest.approx(0.9**5)
    assert power.sign_test_critical(10, 0.05) == 9  # P(X >= 9) = 11/1024; P(X >= 8) = 56/1024
    assert power.sign_test_power(10, 0.8, 0.05) == pytest.approx(10 * 0.8**9 * 0.2 + 0.8**10)
    assert power.mde_sign_test(1.0, 3, 0.05, 0.8) == float("inf") and power.seeds_sign_test(1.0, 10.0, 0.05, 0.8) == 5
    mde = power.mde_sign_test(2.0, 5, 0.05, 0.8)  # q = 0.8 ** (1/5) per seed gives power 0.8
    assert mde == pytest.approx(2.0 * power.z(0.8 ** 0.2), rel=1e-6)
    assert power.binomial_floor(0.5, 0.0, 100, 4) == pytest.approx(np.sqrt(0.5 / 400))


def test_a_claim_reported_after_a_run_with_its_design_label(tmp_path):
    """Whatever the test reads, a claim its design cannot resolve carries the label, never a verdict."""
    runs = _claims_store(tmp_path, 0.0)
    label = "not resolvable at this scale (needs ~900 seeds)"
    design = Resolvability("c", "cpu", "paired mean", 0.05, 0.8, 3, 0.02, "prior", 0.03, 0.002, 0.0, False, 900, label, "synthetic")
    with Store(tmp_path) as store:
        result = with_resolvability(evaluate_claim(store, runs, _claim()), design)
    assert result.verdict == label and "the test alone reads 'inconclusive'" in result.reasons[-1]
