"""`harness gate`: the exact McNemar and paired bootstrap tests, their false-alarm rate by simulation,
regressions caught, errored/missing samples never passing, and the command's exit codes on stored results."""

from __future__ import annotations

import json
from math import comb

import numpy as np
import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.gate import judge, mcnemar_exact_p
from opd_harness.store import SampleRow, Store

runner = CliRunner()


def simulate_pair(rng: np.random.Generator, n: int, k: int, drop: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Two checkpoints' (problems, k) 0/1 scores on the same problems: per-problem difficulty p ~ U(0, 1), the
    candidate's pass probability p - drop (same problems, independent samples)."""
    p = rng.random(n)
    base = (rng.random((n, k)) < p[:, None]).astype(float)
    cand = (rng.random((n, k)) < np.clip(p - drop, 0, 1)[:, None]).astype(float)
    return base, cand


def test_mcnemar_exact_p_is_the_binomial_tail():
    assert mcnemar_exact_p(10, 0) == pytest.approx(1 / 1024)
    assert mcnemar_exact_p(8, 2) == pytest.approx((comb(10, 8) + comb(10, 9) + comb(10, 10)) / 1024)
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(0, 7) == 1.0  # the candidate only ever wins: no evidence of a regression
    assert mcnemar_exact_p(5, 5) == pytest.approx(sum(comb(10, i) for i in range(5, 11)) / 1024)


def test_k1_uses_exact_mcnemar_on_discordant_problems():
    base = np.array([[1.0]] * 12 + [[0.0]] * 8)
    cand = np.array([[0.0]] * 10 + [[1.0]] * 2 + [[0.0]] * 7 + [[1.0]])  # 10 baseline-only passes, 1 candidate-only
    v = judge(base, cand, n_resamples=500)
    assert v.worst_case.test == "exact McNemar" and (v.worst_case.worse, v.worst_case.better) == (10, 1)
    assert v.worst_case.p_value == pytest.approx(mcnemar_exact_p(10, 1)) and v.worst_case.p_value < 0.05
    assert v.verdict == "regression"


ALPHA, REPS = 0.05, 1000
TWO_SE = 2 * np.sqrt(ALPHA * (1 - ALPHA) / REPS)


@pytest.mark.parametrize(
    "n, k, n_resamples",
    [
        # The exact test is conservative by discreteness (its size is <= alpha); with ~330 discordant problems it is
        # close to alpha (about 0.044 here), so the rate must land within 2 SE of alpha.
        (1000, 1, 200),  # k = 1: exact McNemar (the bootstrap only reports an interval here)
        (100, 4, 2000),  # k = 4: paired bootstrap
    ],
)
def test_false_alarm_rate_on_pure_noise_is_alpha(n, k, n_resamples):
    """1,000 simulated null pairs (the same model sampled twice): the gate flags about alpha of them."""
    rng = np.random.default_rng(12)
    flagged = 0
    for rep in range(REPS):
        base, cand = simulate_pair(rng, n, k)
        flagged += judge(base, cand, alpha=ALPHA, n_resamples=n_resamples, seed=rep).verdict == "regression"
    rate = flagged / REPS
    assert abs(rate - ALPHA) <= TWO_SE, f"false-alarm rate {rate:.3f}, expected {ALPHA} ± {TWO_SE:.3f}"


@pytest.mark.parametrize("k", [1, 4])
def test_a_real_regression_is_caught_and_an_improvement_passes(k):
    rng = np.random.default_rng(3)
    hits = passes = 0
    for rep in range(50):
        base, cand = simulate_pair(rng, 200, k, drop=0.15)
        hits += judge(base, cand, n_resamples=1000, seed=rep).verdict == "regression"
        passes += judge(cand, base, n_resamples=1000, seed=rep).verdict == "pass"  # swapped: an improvement
    assert hits >= 45 and passes == 50


def test_max_drop_tolerates_small_drops_but_not_large_ones():
    rng = np.random.default_rng(5)
    base, small = simulate_pair(rng, 300, 4, drop=0.03)
    assert judge(base, small, n_resamples=2000).verdict == "regression"  # 3 points on 300 problems x 4 samples is detectable
    assert judge(base, small, max_drop=0.10, n_resamples=2000).verdict == "pass"
    base, large = simulate_pair(rng, 300, 4, drop=0.30)
    assert judge(base, large, max_drop=0.10, n_resamples=2000).verdict == "regression"


def test_max_drop_with_k1_needs_the_exact_test_and_the_bound():
    rng = np.random.default_rng(9)
    base, cand = simulate_pair(rng, 2000, 1, drop=0.04)  # a 4-point drop on 2,000 problems: significant
    assert judge(base, cand, n_resamples=2000).verdict == "regression"
    tolerant = judge(base, cand, max_drop=0.10, n_resamples=2000)
    assert tolerant.worst_case.p_value < 0.05 and tolerant.worst_case.ci_high > -0.10 and tolerant.verdict == "pass"


def test_overall_test_catches_a_diffuse_regression_and_bonferroni_splits_alpha(tmp_path):
    """Four tasks each 4 points worse: too little for any one task at alpha/5, enough for the macro-average."""
    rng = np.random.default_rng(4)
    with Store(tmp_path) as store:
        for run in ("a", "b"):
            store.create_run(run, kind="eval", config={})
        for task in ("t1", "t2", "t3", "t4"):
            p = rng.random(150)
            _store_eval(store, "a", 0, task, (rng.random((150, 4)) < p[:, None]).astype(float))
            _store_eval(store, "b", 0, task, (rng.random((150, 4)) < np.clip(p - 0.04, 0, 1)[:, None]).astype(float))
    result = runner.invoke(app, ["gate", "--baseline", "a", "--candidate", "b", "--out", str(tmp_path), "--json"])
    report = json.loads(result.stdout)
    assert [t["alpha"] for t in report["tasks"]] == [pytest.approx(0.01)] * 4  # 4 tasks + overall = 5 tests
    assert [t["verdict"] for t in report["tasks"]] == ["pass"] * 4
    assert report["overall"]["verdict"] == "regression" and report["overall"]["worst_case"]["delta"] < -0.03
    assert result.exit_code == 1 and report["verdict"] == "regression"


def test_grading_errors_make_the_verdict_inconclusive_not_pass():
    """A regression whose failures surface as grading errors: too many errors -> inconclusive; a few errors that
    could hide the regression -> inconclusive too; the errors never turn it into a pass."""
    rng = np.random.default_rng(7)
    base, cand = simulate_pair(rng, 200, 4, drop=0.0)
    cand_err = cand.copy()
    cand_err[rng.random(cand.shape) < 0.10] = np.nan  # 10% of the candidate's samples errored
    v = judge(base, cand_err, n_resamples=1000)
    assert v.verdict == "inconclusive" and v.blocked and any("errored or missing" in r for r in v.reasons)

    # Under the threshold but decisive: the candidate errs exactly where the baseline passed on 8 of 200 problems.
    base = np.ones((200, 1))
    cand = np.ones((200, 1))
    cand[:8] = np.nan  # 4% errors: allowed by --max-error-rate 0.05, yet 8 worse vs 0 better if they were failures
    v = judge(base, cand, max_bad_rate=0.05, n_resamples=1000)
    assert v.worst_case.regression and not v.best_case.regression
    assert v.verdict == "inconclusive" and not v.blocked

    # Missing samples (an evaluation that stopped early) count the same way.
    cand = np.ones((200, 1))
    cand[150:] = np.nan
    assert judge(base, cand, n_resamples=1000).verdict == "inconclusive"


def test_too_few_problems_is_inconclusive():
    v = judge(np.zeros((5, 4)), np.ones((5, 4)), min_problems=10, n_resamples=500)
    assert v.verdict == "inconclusive" and "only 5 problems" in v.reasons[0]


# ---- the command on stored results -----------------------------------------------------------------


def _store_eval(
    store: Store, run_id: str, step: int, task: str, scores: np.ndarray, *, errors: np.ndarray | None = None, grader: str = "exact 1"
) -> None:
    """An evaluation of (problems, k) 0/1 ``scores`` written through the Store API, as `harness run` writes one."""
    rows = []
    for i, per_problem in enumerate(scores):
        for j, score in enumerate(per_problem):
            errored = errors is not None and bool(errors[i, j])
            status = "error" if errored else "pass" if score else "fail"
            rows.append(SampleRow(f"p{i:03d}", j, "completion", None, 0.0 if errored else float(score), status, 0.0))
    valid = np.where(errors, np.nan, scores) if errors is not None else scores
    summary = {"k": scores.shape[1], "n_samples": scores.size, "n_problems": len(scores), "avg_at_k": float(np.nanmean(valid)),
               "ci_low": 0.0, "ci_high": 1.0, "n_errors": int(errors.sum()) if errors is not None else 0}  # fmt: skip
    name, version = grader.split()
    store.add_eval(run_id, step, task, summary, rows, grader=name, grader_version=version)


@pytest.fixture
def demo_store(tmp_path):
    """A training run like the CPU demo's: step 0 (the SFT'd student) is weak, step 500 (after distillation) much stronger,
    on 200 problems x 4 samples of two tasks."""
    rng = np.random.default_rng(0)
    with Store(tmp_path) as store:
        store.create_run("demo", kind="train", config={}, method="m", task="t1")
        for task in ("t1", "t2"):
            p = rng.random(200)
            _store_eval(store, "demo", 0, task, (rng.random((200, 4)) < 0.5 * p[:, None]).astype(float))
            _store_eval(store, "demo", 500, task, (rng.random((200, 4)) < np.clip(p + 0.3, 0, 1)[:, None]).astype(float))
        store.set_status("demo", "done")
    return tmp_path


def test_gate_cli_improvement_passes_and_regression_fails(demo_store, tmp_path):
    improved = runner.invoke(app, ["gate", "--baseline", "demo:0", "--candidate", "demo", "--out", str(demo_store), "--json"])
    assert improved.exit_code == 0, improved.output
    assert improved.stderr.startswith("PASS")  # --json: the report on stdout, the paragraph on stderr
    report = json.loads(improved.stdout)
    assert report["candidate"] == "demo:500"  # no step: the run's last evaluated one
    assert report["verdict"] == "pass" and report["exit_code"] == 0 and [t["task"] for t in report["tasks"]] == ["t1", "t2"]
    assert report["overall"]["verdict"] == "pass" and report["tasks"][0]["alpha"] == pytest.approx(
        0.05 / 3
    )  # Bonferroni: 2 tasks + overall

    regressed = runner.invoke(
        app, ["gate", "--baseline", "demo:500", "--candidate", "demo:0", "--task", "t1", "--out", str(demo_store), "--json"]
    )
    assert regressed.exit_code == 1, regressed.output
    report = json.loads(regressed.stdout)
    assert report["verdict"] == "regression" and report["overall"] is None and len(report["tasks"]) == 1
    assert report["tasks"][0]["worst_case"]["delta"] < -0.2


def test_gate_cli_regression_against_an_earlier_step(demo_store):
    result = runner.invoke(app, ["gate", "--baseline", "demo:500", "--candidate", "demo:0", "--out", str(demo_store)])
    assert result.exit_code == 1 and result.output.startswith("REGRESSION"), result.output
    assert "t1: Avg@4" in result.output and "t2: Avg@4" in result.output and "overall" in result.output


def test_gate_cli_grading_errors_are_inconclusive(tmp_path):
    rng = np.random.default_rng(1)
    scores = (rng.random((100, 4)) < 0.6).astype(float)
    errors = rng.random((100, 4)) < 0.05
    with Store(tmp_path) as store:
        for run in ("a", "b"):
            store.create_run(run, kind="eval", config={})
        _store_eval(store, "a", 0, "t", scores)
        _store_eval(store, "b", 0, "t", scores, errors=errors)  # identical answers, but 5% of them failed to grade
    result = runner.invoke(app, ["gate", "--baseline", "a", "--candidate", "b", "--out", str(tmp_path)])
    assert result.exit_code == 3 and result.output.startswith("INCONCLUSIVE"), result.output
    assert "errored or missing" in result.output


def test_gate_cli_different_graders_are_inconclusive(tmp_path):
    scores = (np.random.default_rng(2).random((50, 1)) < 0.5).astype(float)
    with Store(tmp_path) as store:
        for run, grader in (("a", "exact 1"), ("b", "exact 2")):
            store.create_run(run, kind="eval", config={})
            _store_eval(store, run, 0, "t", scores, grader=grader)
    result = runner.invoke(app, ["gate", "--baseline", "a", "--candidate", "b", "--out", str(tmp_path)])
    assert result.exit_code == 3 and "graded differently" in result.output, result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--baseline", "nope", "--candidate", "demo"], "no run 'nope'"),
        (["--baseline", "demo:7", "--candidate", "demo"], "no evaluation at step 7"),
        (["--baseline", "demo:x", "--candidate", "demo"], "RUN:STEP"),
        (["--baseline", "demo:0", "--candidate", "demo", "--task", "t3"], "not evaluated on ['t3']"),
        (["--baseline", "demo:0", "--candidate", "demo", "--alpha", "0.7"], "--alpha"),
        (["--baseline", "demo:0", "--candidate", "demo", "--max-drop", "-1"], "--max-drop"),
    ],
)
def test_gate_cli_usage_errors_exit_2(demo_store, args, message):
    result = runner.invoke(app, ["gate", *args, "--out", str(demo_store)])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_gate_cli_without_a_store_exits_2(tmp_path):
    result = runner.invoke(app, ["gate", "--baseline", "a", "--candidate", "b", "--out", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no results store" in result.output


# ---- model paths: evaluated first, on the same problems and seeds -----------------------------------


def _replay(path, problems, wrong: set[int]):
    """A replay 'model' (harness eval --backend replay): the right answer except on the problems in ``wrong``."""
    rows = [
        {"task": "arith", "id": p.id, "completion": f"\\boxed{{{int(p.answer) + (1 if i in wrong else 0)}}}"}
        for i, p in enumerate(problems)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gate_evaluates_model_paths_first_and_reuses_the_evaluations(tmp_path):
    from opd_harness.tasks.synthetic.arith import ArithOptions, ArithTask

    problems = ArithTask(ArithOptions()).load("test")[:30]
    good = _replay(tmp_path / "good.jsonl", problems, wrong=set())
    worse = _replay(tmp_path / "worse.jsonl", problems, wrong=set(range(12)))
    out = tmp_path / "results"
    args = [
        "gate",
        "--task",
        "arith",
        "--k",
        "1",
        "--limit",
        "30",
        "--backend",
        "replay",
        "--out",
        str(out),
        "--json",
    ]
    regressed = runner.invoke(app, [*args, "--baseline", str(good), "--candidate", str(worse)])
    assert regressed.exit_code == 1, regressed.output
    report = json.loads(regressed.stdout)
    task = report["tasks"][0]
    assert (task["avg_baseline"], task["avg_candidate"], task["n_problems"]) == (1.0, pytest.approx(0.6), 30)
    assert (task["worst_case"]["test"], task["worst_case"]["worse"], task["worst_case"]["better"]) == ("exact McNemar", 12, 0)
    with Store(out) as store:
        runs = [r["run_id"] for r in store.runs()]
        assert len(runs) == 2 and all(store.get_run(r)["config"]["backend"] == "replay" for r in runs)

    improved = runner.invoke(app, [*args, "--baseline", str(worse), "--candidate", str(good)])
    assert improved.exit_code == 0, improved.output
    assert "reused its evaluation" in json.dumps(json.loads(improved.stdout)["notes"])
    with Store(out) as store:
        assert len(store.runs()) == 2  # both evaluations reused: same model, tasks, k, limit, sampling and seed

    # A stored baseline against a path evaluated on fewer problems: the 10 problems it lacks are missing samples.
    stored = runner.invoke(app, [*args, "--baseline", f"{runs[0]}:0", "--candidate", str(worse), "--limit", "20"])
    assert stored.exit_code == 3 and "10 of 30 samples errored or missing" in " ".join(stored.stderr.split()), stored.output
    with Store(out) as store:
        assert len(store.runs()) == 3


def test_gate_json_is_a_flag_and_the_old_file_argument_is_refused_by_name(demo_store, tmp_path):
    """``--json`` prints to stdout in every command; the old ``--json FILE`` would now leave FILE unwritten, so it exits 2
    saying how to keep the report in a file, and nothing is written."""
    for old in (str(tmp_path / "gate.json"), "-"):
        result = runner.invoke(app, ["gate", "--baseline", "demo:0", "--candidate", "demo", "--out", str(demo_store), "--json", old])
        assert result.exit_code == 2 and "--json is a flag" in result.output and "--json > gate.json" in result.output, result.output
    assert not (tmp_path / "gate.json").exists()
    stray = runner.invoke(app, ["gate", "--baseline", "demo:0", "--candidate", "demo", "--out", str(demo_store), "extra"])
    assert stray.exit_code == 2 and "unexpected argument 'extra'" in stray.output


def test_gate_on_a_model_path_needs_tasks_and_a_loadable_model(tmp_path):
    model = tmp_path / "m.jsonl"
    model.write_text("")
    no_task = runner.invoke(app, ["gate", "--baseline", str(model), "--candidate", str(model), "--out", str(tmp_path / "r")])
    assert no_task.exit_code == 2 and "--task" in no_task.output, no_task.output
    not_a_model = runner.invoke(
        app, ["gate", "--baseline", str(tmp_path), "--candidate", str(model), "--task", "arith", "--out", str(tmp_path / "r")]
    )
    assert not_a_model.exit_code == 2 and "cannot evaluate" in not_a_model.output, not_a_model.output
