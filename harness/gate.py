"""Statistical regression gate: is a candidate checkpoint worse than a baseline on the same problems?

Per task, both checkpoints' samples are lined up problem by problem (the first k samples of each);
each problem's value is the mean score of its k samples (Avg@k's unit). The test is one-sided
(H0: the candidate is not worse; the gate only looks for regressions):

- k = 1 with 0/1 scores: exact McNemar test, i.e. a binomial test on the discordant problems
  (baseline right and candidate wrong vs the reverse, p = P(X >= worse) with X ~ Bin(discordant, 1/2));
- otherwise: paired bootstrap over problems of delta = Avg@k(candidate) - Avg@k(baseline),
  p = (1 + #{delta* >= 0}) / (1 + resamples).

A task **regresses** when p < alpha (Bonferroni-divided over the tests: each task, plus an overall
macro-average test when there are several tasks) and the drop is material: the one-sided upper
confidence bound of delta is below ``-max_drop`` (with ``max_drop = 0``: delta < 0).

Errored and missing samples never count as passes: the test is run twice, with every such sample
scored against the candidate (candidate's as 0, baseline's as 1) and in its favour (the reverse).
The verdict is ``pass`` only if even the first shows no regression, ``regression`` only if even
the second shows one, ``inconclusive`` otherwise, and ``inconclusive`` outright when a side's
fraction of errored or missing samples exceeds ``max_bad_rate``, when there are fewer than
``min_problems`` problems, or when the two sides were graded by different graders.

Exit codes (``harness gate``): 0 pass, 1 regression, 2 usage error, 3 inconclusive.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from opd_harness.leaderboard import sample_scores
from opd_harness.metrics import resampled_means
from opd_harness.store import Store
from opd_harness.task import TaskNotReady, close_tasks
from opd_harness.viewer import problem_flips

EXIT_CODES = {"pass": 0, "regression": 1, "inconclusive": 3}


class GateUsageError(ValueError):
    """A bad reference or task (unknown run, step without evaluation): the CLI exits 2 with the message."""


# ---- the tests ------------------------------------------------------------------------------------


def mcnemar_exact_p(worse: int, better: int) -> float:
    """One-sided exact McNemar p-value P(X >= worse), X ~ Bin(worse + better, 1/2): the chance of at
    least ``worse`` baseline-only passes among the discordant problems if neither side is better."""
    n = worse + better
    if n == 0:
        return 1.0
    return math.fsum(math.comb(n, i) for i in range(worse, n + 1)) / 2.0**n


def bootstrap_deltas(diffs: list[np.ndarray], n_resamples: int, seed: int) -> np.ndarray:
    """Resampled macro-average deltas: each task's problems resampled on their own (stratified), tasks averaged."""
    return np.mean([resampled_means(d, n_resamples, seed + i) for i, d in enumerate(diffs)], axis=0)


@dataclass(frozen=True)
class OneSidedResult:
    """One one-sided test of 'candidate worse than baseline' on imputed per-problem values."""

    test: str  # "exact McNemar" or "paired bootstrap"
    delta: float  # Avg@k(candidate) - Avg@k(baseline)
    p_value: float  # one-sided, H0: the candidate is not worse
    ci_low: float  # two-sided (1 - 2 alpha') interval of delta; ci_high is the one-sided upper bound
    ci_high: float
    worse: int | None = None  # McNemar: problems only the baseline solved
    better: int | None = None  # McNemar: problems only the candidate solved
    regression: bool = False


def one_sided_test(
    base: list[np.ndarray], cand: list[np.ndarray], *, alpha: float, max_drop: float, n_resamples: int, seed: int
) -> OneSidedResult:
    """Test 'candidate worse by more than max_drop' on (problems, k) score matrices without NaN, one pair per task.

    One task with k = 1 and 0/1 scores gets the exact McNemar test; anything else the (stratified) paired bootstrap.
    The bootstrap interval is reported in both cases and decides materiality when ``max_drop > 0``.
    """
    diffs = [c.mean(axis=1) - b.mean(axis=1) for b, c in zip(base, cand, strict=True)]
    delta = float(np.mean([d.mean() for d in diffs]))
    deltas = bootstrap_deltas(diffs, n_resamples, seed)
    ci_low, ci_high = (float(q) for q in np.quantile(deltas, [alpha, 1.0 - alpha]))
    binary = len(base) == 1 and base[0].shape[1] == 1 and all(np.isin(m, (0.0, 1.0)).all() for m in (base[0], cand[0]))
    worse = better = None
    if binary:
        b, c = base[0][:, 0], cand[0][:, 0]
        worse, better = int(np.sum((b == 1) & (c == 0))), int(np.sum((b == 0) & (c == 1)))
        p, test = mcnemar_exact_p(worse, better), "exact McNemar"
    else:
        p, test = float((1 + np.sum(deltas >= 0)) / (1 + len(deltas))), "paired bootstrap"
    material = ci_high < -max_drop if max_drop > 0 else delta < 0
    return OneSidedResult(test, delta, float(p), ci_low, ci_high, worse, better, bool(p < alpha and material))


# ---- one task -------------------------------------------------------------------------------------


@dataclass
class TaskVerdict:
    """The gate's verdict on one task (or ``overall``), with what it rests on."""

    task: str
    verdict: str  # pass | regression | inconclusive
    k: int
    n_problems: int
    avg_baseline: float | None  # Avg@k over valid samples (errors excluded, as the leaderboard shows it)
    avg_candidate: float | None
    bad_baseline: int  # errored or missing samples among the n_problems x k expected
    bad_candidate: int
    alpha: float  # the per-test level after the Bonferroni split
    worst_case: OneSidedResult | None  # bad samples scored against the candidate
    best_case: OneSidedResult | None  # bad samples scored in its favour
    reasons: list[str] = field(default_factory=list)
    blocked: bool = False  # inconclusive before any test: too few problems, too many bad samples, different graders

    def to_dict(self) -> dict:
        return asdict(self)


def _valid_avg(scores: np.ndarray) -> float | None:
    """Avg@k over problems with at least one valid sample (NaN = errored or missing), as the leaderboard computes it."""
    valid = ~np.isnan(scores)
    rows = valid.any(axis=1)
    if not rows.any():
        return None
    return float((np.where(valid, scores, 0.0).sum(axis=1)[rows] / valid.sum(axis=1)[rows]).mean())


def judge(
    base: np.ndarray,
    cand: np.ndarray,
    *,
    task: str = "task",
    alpha: float = 0.05,
    max_drop: float = 0.0,
    min_problems: int = 10,
    max_bad_rate: float = 0.02,
    n_resamples: int = 10_000,
    seed: int = 0,
    blockers: tuple[str, ...] = (),
) -> TaskVerdict:
    """Verdict on one task from aligned (problems, k) score matrices; NaN marks an errored or missing sample.

    ``blockers``: reasons found elsewhere (e.g. different graders) that make the task inconclusive.
    """
    if base.shape != cand.shape or base.ndim != 2:
        raise ValueError(f"score matrices must have the same (problems, k) shape, got {base.shape} and {cand.shape}")
    n, k = base.shape
    bad_b, bad_c = int(np.isnan(base).sum()), int(np.isnan(cand).sum())
    reasons = list(blockers)
    if n < min_problems:
        reasons.append(f"only {n} problems (fewer than --min-problems {min_problems})")
    for side, bad in (("baseline", bad_b), ("candidate", bad_c)):
        if n and bad / (n * k) > max_bad_rate:
            reasons.append(
                f"{side}: {bad} of {n * k} samples errored or missing ({bad / (n * k):.1%} > --max-error-rate {max_bad_rate:.1%})"
            )
    kw = {"alpha": alpha, "max_drop": max_drop, "n_resamples": n_resamples, "seed": seed}
    worst, best = _bounds([(base, cand)], **kw) if n else (None, None)
    verdict, decided_by_bad = _decide(worst, best, blocked=bool(reasons))
    if decided_by_bad:
        reasons.append(
            f"the {bad_b + bad_c} errored or missing samples decide the verdict "
            "(a regression if they count against the candidate, none if for it)"
        )
    return TaskVerdict(
        task,
        verdict,
        k,
        n,
        _valid_avg(base),
        _valid_avg(cand),
        bad_b,
        bad_c,
        alpha,
        worst,
        best,
        reasons,
        blocked=bool(reasons) and not decided_by_bad,
    )


def _bounds(pairs: list[tuple[np.ndarray, np.ndarray]], **kw) -> tuple[OneSidedResult, OneSidedResult]:
    """The test with every NaN (errored/missing) sample scored against the candidate, and in its favour."""
    worst = one_sided_test([np.nan_to_num(b, nan=1.0) for b, _ in pairs], [np.nan_to_num(c, nan=0.0) for _, c in pairs], **kw)
    if not any(np.isnan(b).any() or np.isnan(c).any() for b, c in pairs):
        return worst, worst
    best = one_sided_test([np.nan_to_num(b, nan=0.0) for b, _ in pairs], [np.nan_to_num(c, nan=1.0) for _, c in pairs], **kw)
    return worst, best


def _decide(worst: OneSidedResult | None, best: OneSidedResult | None, *, blocked: bool) -> tuple[str, bool]:
    """(verdict, whether the bad samples alone made it inconclusive): pass only if even the worst case shows no
    regression, regression only if even the best case shows one."""
    if blocked or worst is None or best is None:
        return "inconclusive", False
    if best.regression:
        return "regression", False
    if not worst.regression:
        return "pass", False
    return "inconclusive", True


def judge_overall(
    verdicts: list[TaskVerdict],
    matrices: list[tuple[np.ndarray, np.ndarray]],
    *,
    alpha: float,
    max_drop: float,
    n_resamples: int,
    seed: int,
) -> TaskVerdict:
    """Macro-average over tasks (each task weighs the same), stratified paired bootstrap, with the same worst/best-case rule."""
    blocked = [v.task for v in verdicts if v.blocked]
    reasons = [f"task {task} is inconclusive (see its reasons)" for task in blocked]
    pairs = [m for v, m in zip(verdicts, matrices, strict=True) if v.n_problems]
    kw = {"alpha": alpha, "max_drop": max_drop, "n_resamples": n_resamples, "seed": seed}
    worst, best = _bounds(pairs, **kw) if pairs else (None, None)
    verdict, decided_by_bad = _decide(worst, best, blocked=bool(blocked))
    if decided_by_bad:
        reasons.append("the errored or missing samples decide the overall verdict")
    avgs_b, avgs_c = [v.avg_baseline for v in verdicts], [v.avg_candidate for v in verdicts]
    return TaskVerdict(
        "overall", verdict, 0, sum(v.n_problems for v in verdicts),
        float(np.mean(avgs_b)) if None not in avgs_b else None, float(np.mean(avgs_c)) if None not in avgs_c else None,
        sum(v.bad_baseline for v in verdicts), sum(v.bad_candidate for v in verdicts), alpha, worst, best, reasons, blocked=bool(blocked),
    )  # fmt: skip


# ---- from the results store -----------------------------------------------------------------------


def parse_ref(text: str, flag: str) -> tuple[str, int | None]:
    """``RUN[:STEP]`` -> (run id, step or None for the run's last evaluated step)."""
    run_id, sep, step = text.rpartition(":")
    if not sep:
        return text, None
    if not step.isdigit() or not run_id:
        raise GateUsageError(f"{flag} {text!r}: expected RUN or RUN:STEP with STEP a checkpoint step (an integer)")
    return run_id, int(step)


def split_ref(store: Store, text: str, flag: str) -> tuple[str, int | None]:
    """:func:`parse_ref`, except that a stored run's whole id is that run (a run id holds its task's name, which may have
    a colon: ``eval-<prefix>:<task>-…``)."""
    return (text, None) if store.get_run(text) is not None else parse_ref(text, flag)


def resolve_ref(store: Store, text: str, flag: str, tasks: list[str] | None) -> tuple[str, int]:
    """The (run, step) a ``--baseline``/``--candidate`` names; without a step, the last step evaluated on every task asked for."""
    run_id, step = split_ref(store, text, flag)
    evals = store.evals(run_id)
    if store.get_run(run_id) is None:
        raise GateUsageError(f"{flag} {text!r}: no run {run_id!r} in {store.path} (see `harness leaderboard {store.root}`)")
    if not evals:
        raise GateUsageError(f"{flag} {text!r}: run {run_id!r} has no evaluations")
    steps: dict[int, set[str]] = {}
    for e in evals:
        steps.setdefault(e["step"], set()).add(e["task"])
    wanted = set(tasks or [])
    if step is None:
        usable = [s for s, done in steps.items() if wanted <= done]
        if not usable:
            raise GateUsageError(f"{flag} {text!r}: no checkpoint of {run_id} was evaluated on all of {sorted(wanted)}")
        return run_id, max(usable)
    if step not in steps:
        raise GateUsageError(f"{flag} {text!r}: run {run_id} has no evaluation at step {step} (evaluated steps: {sorted(steps)})")
    missing = wanted - steps[step]
    if missing:
        raise GateUsageError(
            f"{flag} {text!r}: step {step} of {run_id} was not evaluated on {sorted(missing)} (evaluate it with `harness eval`)"
        )
    return run_id, step


def score_matrices(
    store: Store, baseline: tuple[str, int], candidate: tuple[str, int], task: str, k: int
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Problem ids (the union of both sides) and aligned (problems, k) score matrices; NaN = errored or missing sample."""
    base, cand = sample_scores(store, *baseline, task, k), sample_scores(store, *candidate, task, k)
    problems = sorted(set(base) | set(cand))
    missing = np.full(k, np.nan)
    return (
        problems,
        np.array([base.get(p, missing) for p in problems]).reshape(-1, k),
        np.array([cand.get(p, missing) for p in problems]).reshape(-1, k),
    )


# ---- model paths: evaluate them first, on the same problems, k, sampling and seed ---------------


@dataclass(frozen=True)
class EvalSpec:
    """How the gate evaluates a model path (both sides alike); the run config has ``harness eval``'s shape."""

    tasks: tuple[str, ...]
    k: int | None = None
    limit: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    task_args: dict = field(default_factory=dict)
    backend: str = "hf"
    backend_options: dict = field(default_factory=dict)
    data_dir: Path | None = None

    def config(self, model: str) -> dict:
        return {"task_args": self.task_args, "backend_options": self.backend_options, "model": model, "backend": self.backend,
                "tasks": list(self.tasks), "k": self.k, "limit": self.limit, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}  # fmt: skip


def find_eval_run(store: Store, model: str, spec: EvalSpec) -> str | None:
    """The newest finished eval run of ``model`` made with exactly ``spec`` (by `harness eval` or an earlier gate), if any."""
    wanted = spec.config(model)
    for run in reversed(store.runs()):
        if run["kind"] != "eval" or run["status"] != "done":
            continue
        config = (store.get_run(run["run_id"]) or {}).get("config", {})
        same = all(config.get(key) == value for key, value in wanted.items() if key != "tasks")
        if same and set(spec.tasks) <= set(config.get("tasks") or []):
            return run["run_id"]
    return None


def evaluate_model(store: Store, model: str, spec: EvalSpec) -> str:
    """Evaluate ``model`` on ``spec`` into a new eval run, as `harness eval` would; returns the run id.

    Problems are loaded and the tasks checked before the model is loaded or the run row created;
    a bad task, missing data or a model that does not load is a GateUsageError.
    """
    from opd_harness.backends import SamplingParams
    from opd_harness.config import ConfigError
    from opd_harness.evaluation import evaluate_task, store_eval
    from opd_harness.plan import load_problems, make_task
    from opd_harness.registry import BACKENDS, RegistryError
    from opd_harness.runs import new_run_id

    tasks = []
    try:
        try:
            tasks = [make_task(name, spec.task_args) for name in spec.tasks]
            problems = {t.name: load_problems(t, "test", data_dir=spec.data_dir, limit=spec.limit) for t in tasks}
            for t in tasks:
                t.check_ready()
            engine = BACKENDS.get(spec.backend).load(model, **spec.backend_options)
        except (ConfigError, RegistryError, TaskNotReady, OSError, ValueError, TypeError) as exc:
            raise GateUsageError(f"cannot evaluate {model}: {exc}") from None
        run_id = new_run_id("eval", "+".join(spec.tasks))
        store.create_run(run_id, kind="eval", config=spec.config(model), task=",".join(spec.tasks), model=model)
        try:
            for t in tasks:
                sampling = SamplingParams(
                    temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=t.options.max_new_tokens, seed=spec.seed
                )
                store_eval(store, run_id, 0, evaluate_task(engine, t, problems[t.name], k=spec.k or t.options.k, sampling=sampling))
        except BaseException:
            store.set_status(run_id, "failed")
            raise
        store.set_status(run_id, "done")
        return run_id
    finally:
        close_tasks(tasks)


def resolve_model_refs(store: Store, refs: dict[str, str], spec: EvalSpec | None) -> tuple[dict[str, str], list[str]]:
    """Replace each reference that names no stored run but an existing path (a model directory, a replay file) by the
    eval run of that model under ``spec``, evaluating it first when the store has none; returns the refs and notes."""
    out, notes = dict(refs), []
    for flag, text in refs.items():
        run_id = text.rpartition(":")[0] if text.rpartition(":")[2].isdigit() else text
        if store.get_run(run_id) is not None or not Path(text).exists():
            continue
        if spec is None:
            raise GateUsageError(f"{flag} {text!r} is a path, not a run of {store.path}: name the tasks with --task to evaluate it first")
        found = find_eval_run(store, text, spec)
        if found:
            notes.append(f"{flag} {text}: reused its evaluation {found}")
        else:
            found = evaluate_model(store, text, spec)
            notes.append(f"{flag} {text}: evaluated into {found}")
        out[flag] = f"{found}:0"
    return out, notes


@dataclass
class GateReport:
    """Everything ``harness gate`` decided, for the JSON report and the verdict paragraph."""

    verdict: str
    baseline: str
    candidate: str
    alpha: float
    max_drop: float
    tasks: list[TaskVerdict]
    overall: TaskVerdict | None
    notes: list[str] = field(default_factory=list)
    flips: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # task -> pass_to_fail / fail_to_pass problem ids
    viewer: str | None = None  # the comparison page (``harness gate --html``), when written

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict:
        return {**asdict(self), "exit_code": self.exit_code}


def gate(
    store: Store,
    baseline: str,
    candidate: str,
    tasks: list[str] | None = None,
    *,
    alpha: float = 0.05,
    max_drop: float = 0.0,
    min_problems: int = 10,
    max_bad_rate: float = 0.02,
    n_resamples: int = 10_000,
    seed: int = 0,
    eval_spec: EvalSpec | None = None,
) -> GateReport:
    """Compare two checkpoints task by task and overall; raises GateUsageError on bad references.

    A reference is a stored ``RUN[:STEP]``, or a model path (directory, replay file) that is evaluated first with
    ``eval_spec`` (reusing an identical earlier evaluation of it in the store).
    """
    if not 0 < alpha < 0.5:
        raise GateUsageError(f"--alpha {alpha}: must be in (0, 0.5)")
    if not 0 <= max_drop < 1:
        raise GateUsageError(f"--max-drop {max_drop}: must be in [0, 1) (absolute Avg@k points, e.g. 0.02)")
    refs, eval_notes = resolve_model_refs(store, {"--baseline": baseline, "--candidate": candidate}, eval_spec)
    baseline, candidate = refs["--baseline"], refs["--candidate"]
    base_ref = resolve_ref(store, baseline, "--baseline", tasks)
    cand_ref = resolve_ref(store, candidate, "--candidate", tasks)
    if tasks is None:
        tasks = sorted(
            {e["task"] for e in store.evals(base_ref[0]) if e["step"] == base_ref[1]}
            & {e["task"] for e in store.evals(cand_ref[0]) if e["step"] == cand_ref[1]}
        )
        if not tasks:
            raise GateUsageError(f"--baseline {baseline} and --candidate {candidate} share no evaluated task; name them with --task")
    n_tests = len(tasks) + (1 if len(tasks) > 1 else 0)
    per_test_alpha = alpha / n_tests  # Bonferroni: the family of tests (tasks + overall) keeps its false-alarm rate at alpha
    notes = eval_notes + (
        [f"Bonferroni: {n_tests} tests at alpha {alpha:g} / {n_tests} = {per_test_alpha:.4g} each"] if n_tests > 1 else []
    )
    verdicts, matrices, flips = [], [], {}
    for task in tasks:
        ev = {
            side: next(e for e in store.evals(ref[0]) if e["step"] == ref[1] and e["task"] == task)
            for side, ref in (("base", base_ref), ("cand", cand_ref))
        }
        k = min(ev["base"]["k"], ev["cand"]["k"])
        if ev["base"]["k"] != ev["cand"]["k"]:
            notes.append(f"{task}: baseline k={ev['base']['k']}, candidate k={ev['cand']['k']}; compared on the first {k} samples")
        graders = {side: f"{e['grader']} {e['grader_version']}" for side, e in ev.items()}
        blockers = (
            ()
            if graders["base"] == graders["cand"]
            else (f"graded differently: baseline by {graders['base']}, candidate by {graders['cand']}",)
        )
        problems, b, c = score_matrices(store, base_ref, cand_ref, task, k)
        flips[task] = problem_flips(problems, b, c)
        kw = {"alpha": per_test_alpha, "max_drop": max_drop, "n_resamples": n_resamples, "seed": seed}
        verdicts.append(judge(b, c, task=task, min_problems=min_problems, max_bad_rate=max_bad_rate, blockers=blockers, **kw))
        matrices.append((b, c))
    overall = (
        judge_overall(verdicts, matrices, alpha=per_test_alpha, max_drop=max_drop, n_resamples=n_resamples, seed=seed)
        if len(tasks) > 1
        else None
    )
    judged = [*verdicts, *([overall] if overall else [])]
    verdict = (
        "regression"
        if any(v.verdict == "regression" for v in judged)
        else "inconclusive"
        if any(v.verdict == "inconclusive" for v in judged)
        else "pass"
    )
    fmt = lambda ref: f"{ref[0]}:{ref[1]}"  # noqa: E731
    return GateReport(verdict, fmt(base_ref), fmt(cand_ref), alpha, max_drop, verdicts, overall, notes, flips)


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _describe(v: TaskVerdict) -> str:
    """One sentence about one task: the averages, delta, its bound, the test and the verdict."""
    t = v.worst_case
    if t is None:
        return f"{v.task}: {v.verdict} ({'; '.join(v.reasons)})"
    label = f"Avg@{v.k}" if v.k else "mean Avg@k"
    test = (
        f"exact McNemar, {t.worse} worse vs {t.better} better"
        if t.test == "exact McNemar"
        else f"paired bootstrap over {v.n_problems} problems"
    )
    text = (
        f"{v.task}: {label} {_f(v.avg_baseline)} → {_f(v.avg_candidate)}, Δ = {t.delta:+.3f} "
        f"(one-sided {(1 - v.alpha) * 100:.4g}% upper bound {t.ci_high:+.3f}; {test}; p = {t.p_value:.3g}) → {v.verdict}"
    )
    if v.bad_baseline or v.bad_candidate:
        best = v.best_case
        favour = f"; in its favour Δ = {best.delta:+.3f}, p = {best.p_value:.3g}" if best is not None else ""
        text += (
            f" [errored/missing samples: baseline {v.bad_baseline}, candidate {v.bad_candidate}; "
            f"the figures count them against the candidate{favour}]"
        )
    return text + (f" ({'; '.join(v.reasons)})" if v.reasons else "")


def verdict_paragraph(report: GateReport) -> str:
    """The one-paragraph human verdict printed by ``harness gate``."""
    head = {"pass": "PASS: no significant regression", "regression": "REGRESSION", "inconclusive": "INCONCLUSIVE"}[report.verdict]
    drop = f"tolerated drop {report.max_drop:g} Avg@k points" if report.max_drop else "no tolerated drop"
    parts = [f"{head} — candidate {report.candidate} vs baseline {report.baseline} (alpha {report.alpha:g}, one-sided, {drop})."]
    parts += [_describe(v) + "." for v in report.tasks]
    if report.overall is not None:
        parts.append(_describe(report.overall) + ".")
    parts += [n + "." for n in report.notes]
    return " ".join(parts)
