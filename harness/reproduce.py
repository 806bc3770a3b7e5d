"""`harness reproduce NAME`: a paper's experiment as one command, from a recipe kept as data.

A recipe (a YAML file registered under the entry point group ``opd_harness.recipes``; the built-ins live in the
``recipes`` package) holds the paper's grid at two scales, ``paper`` and ``cpu``, each a sweep (``base`` + ``grid``,
the format of :mod:`opd_harness.sweep`) with the source of every value it sets (``sources``: dotted key -> paper
section or table, or ``reconstructed: ...`` where the paper is silent). It also lists its tables, plots and
claims. :func:`reproduce` runs the chosen scale through :func:`opd_harness.sweep.run_sweep` (so it resumes like any
sweep), then renders the tables and plots from the store and checks the claims.

A **claim** compares a candidate arm of runs with a baseline arm (or a constant) on one metric. An arm is ``{name,
where}``; ``differ_in`` names the keys the arms may differ in, and :func:`check_claims` refuses a claim whose arms' full
resolved run configs differ anywhere else (a claim compares one thing). From the paper's ``effect`` and the scale's
``design`` (level, per-seed SD, evaluation size), :func:`resolvability` says before running what the design can detect
(:mod:`opd_harness.power`); a claim it cannot resolve is reported "not resolvable at this scale (needs ~N seeds)", never
with a verdict. The tests:

- ``final_avg``: per-problem scores of each run's last evaluated checkpoint, paired by seed and problem. Each seed's
  Avg@k difference is one observation of the one-sided paired t-test over seeds (:func:`paired_seed_test`), which
  gives delta = candidate - baseline and its (1 - 2 alpha) interval; errored or missing samples are scored against
  the candidate for "holds" and in its favour for "does not hold", as the gate does. The seed is the unit because
  the claim is about training runs: a test that resampled only problems within fixed seeds would count the
  evaluation's noise and not the spread between runs (the spread the design sizes seeds from).
- ``samples_per_hour``, ``step_metric`` (the mean of a logged step metric over the last ``window`` steps) and
  ``eval_metric`` (an evaluation measurement of the last checkpoint, e.g. ``invalid_tool_rate``):
  one value per run, paired by seed, tested with the exact sign test of :mod:`opd_harness.gate` over seeds.

``op: ">"`` claims delta > margin, ``op: ">="`` claims delta > -margin. The claim **holds** when the test
rejects delta <= threshold at level alpha, **does not hold** when it rejects delta >= threshold, and is
**inconclusive** otherwise (or with fewer than ``min_seeds`` paired seeds). Claims are never tuned: the
verdict is what the numbers give.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.console import Console
from scipy.stats import t as student_t

from opd_harness import power
from opd_harness.config import ConfigError, format_validation_error
from opd_harness.gate import mcnemar_exact_p
from opd_harness.leaderboard import sample_scores
from opd_harness.registry import METHODS, Registry, RegistryError
from opd_harness.report import dotted_get, render_markdown, run_curve, sweep_report
from opd_harness.store import Store
from opd_harness.sweep import SweepSpec, expand, load_sweep_record, parse_sweep, run_sweep
from opd_harness.tracking import flatten

RECIPES: Registry[Path] = Registry("recipes")
LAYOUTS = Path(__file__).resolve().parents[1] / "docs" / "layouts"  # the shipped layouts (a source checkout's docs/layouts)
PLACEMENT_KEYS = (
    "trainer.executor", "trainer.device", "trainer.precision", "trainer.activation_checkpointing", "trainer.vocab_chunk",
    "trainer.layout", "trainer.rollout_backend", "trainer.rollout_backend_options", "teacher.backend", "teacher.backend_options",
)  # a layout's keys that say where and how the roles run (not what they train on)
SCALES = ("paper", "cpu")
VERDICTS = ("holds", "does not hold", "inconclusive")
NOT_RESOLVABLE = "not resolvable at this scale"


class RecipeError(ConfigError):
    """A bad recipe or recipe name; the CLI prints it and exits with code 2."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PaperRef(_Strict):
    title: str
    arxiv: str | None = None
    note: str | None = None


class Scale(_Strict):
    sweep: dict[str, Any] = Field(description="a sweep: base (preset/config/set) and grid")
    layout: str | None = Field(
        None, description="paper: the shipped layout (docs/layouts/NAME.yaml) whose placement keys (PLACEMENT_KEYS: executor, "
        "device, precision, Ray layout, engines) every run of the scale takes, under the sweep's own keys",
    )
    layout_source: str | None = Field(None, description="why this layout: the paper's hardware, or 'reconstructed: ...'")
    sources: dict[str, str] = Field(default_factory=dict, description="dotted key -> paper section/table, or 'reconstructed: ...'")
    resources: str | None = Field(None, description="what this scale needs (hardware, time), with its source")
    minutes: str | None = Field(None, description="cpu: the measured or estimated wall time on 2 cores")


class Row(_Strict):
    label: str
    where: dict[str, Any] = Field(description="dotted config key -> value every run of the row has")
    scales: list[Literal["paper", "cpu"]] | None = Field(None, description="the scales whose grids have the row (default: both)")


class TableSpec(_Strict):
    kind: Literal["sweep", "per_task", "step_metrics"]
    title: str
    source: str | None = None
    rows: list[Row] = Field(default_factory=list)
    tasks: list[str] = Field(default_factory=list, description="per_task: evaluation tasks (columns)")
    groups: dict[str, list[str]] = Field(default_factory=dict, description="per_task: domain -> its tasks (macro columns)")
    metrics: list[str] = Field(default_factory=list, description="step_metrics: logged step metrics (columns)")
    window: int = Field(10, ge=1, description="step_metrics: mean over the last N logged steps")


class PlotSpec(_Strict):
    kind: Literal["step_metric", "avg_vs_step"]
    title: str
    rows: list[Row]
    metric: str | None = Field(None, description="step_metric: the logged metric; avg_vs_step: the task")


class Arm(_Strict):
    name: str = Field(description="the arm's label in tables, claims and messages")
    where: dict[str, Any] = Field(description="dotted config key -> value: the runs of the arm (one per seed)")


class Effect(_Strict):
    baseline: float = Field(description="the paper's baseline value on the claim's metric (a fraction: 36.27 % is 0.3627)")
    candidate: float = Field(description="the paper's candidate value")
    source: str = Field(description="the table or section it comes from")
    scaling: Literal["relative", "absolute"] = Field(
        "relative", description="how the paper's effect carries to a scale: relative (candidate/baseline - 1 times the scale's level) "
        "or absolute (candidate - baseline)",
    )


class Design(_Strict):
    """What the resolvability computation assumes at one scale; every value with its source."""

    level: float | None = Field(None, description="the baseline arm's expected value at this scale (default at paper scale: "
                                "effect.baseline)")  # fmt: skip
    sd: float | None = Field(None, ge=0, description="prior: SD over seeds of the per-seed paired difference (candidate - baseline)")
    n_problems: int | None = Field(None, ge=1, description="evaluation problems per run when eval.limit does not say")
    k: int | None = Field(None, ge=1, description="samples per problem when the run's config does not say")
    task: str | None = Field(None, description="the claim's evaluation task at this scale (default: the claim's task)")
    where: dict[str, Any] = Field(
        default_factory=dict, description="added to both arms at this scale: the sub-experiment the claim is about (e.g. one student)",
    )
    source: str = Field(description="where level and sd come from (a measured run and its date, or 'prior: ...')")


class ClaimSpec(_Strict):
    id: str
    text: str
    source: str | None = None
    metric: Literal["final_avg", "samples_per_hour", "step_metric", "eval_metric"]
    task: str | None = Field(None, description="final_avg / eval_metric: the evaluation task (default: the run's training task)")
    step_metric: str | None = Field(None, description="step_metric / eval_metric: the metric's name")
    window: int = Field(10, ge=1)
    candidate: Arm
    baseline: Arm | None = None
    differ_in: list[str] = Field(
        default_factory=list, description="dotted keys (or key prefixes) in which the arms' resolved run configs may differ; "
        "`harness reproduce` refuses the claim when they differ anywhere else",
    )
    value: float | None = Field(None, description="compare with this constant instead of a baseline arm")
    op: Literal[">", ">="] = ">="
    margin: float = Field(0.0, ge=0)
    alpha: float = Field(0.05, gt=0, lt=0.5)
    power: float = Field(0.8, gt=0.5, lt=1, description="the power the resolvability computation asks for")
    min_seeds: int = Field(2, ge=1)
    effect: Effect | None = Field(None, description="the paper's effect on this metric (resolvability)")
    design: dict[Literal["paper", "cpu"], Design] = Field(default_factory=dict, description="per scale: resolvability assumptions")

    @model_validator(mode="after")
    def _arms(self) -> ClaimSpec:
        if self.baseline is None and self.value is None:
            raise ValueError("a claim needs a baseline arm or a constant value")
        if self.baseline is not None and not self.differ_in:
            raise ValueError("differ_in: name the keys in which the arms may differ (the method under test)")
        if self.baseline is None and self.differ_in:
            raise ValueError("differ_in: a claim against a constant has one arm")
        return self


class Recipe(_Strict):
    paper: PaperRef
    scales: dict[Literal["paper", "cpu"], Scale]
    tables: list[TableSpec] = Field(default_factory=list)
    plots: list[PlotSpec] = Field(default_factory=list)
    claims: list[ClaimSpec] = Field(default_factory=list)
    name: str = Field("", exclude=True)


# ---- loading ----------------------------------------------------------------------------------


def parse_recipe(data: dict, name: str) -> Recipe:
    """Validate a recipe mapping; every paper-scale key must have a source."""
    try:
        recipe = Recipe.model_validate({**data, "name": name})
    except ValidationError as exc:
        raise RecipeError(f"recipe {name}: " + format_validation_error(exc, Recipe).replace("\n", f"\nrecipe {name}: ")) from None
    paper = recipe.scales.get("paper")
    if paper is not None and paper.layout and not paper.layout_source:
        raise RecipeError(f"recipe {name}: scales.paper.layout {paper.layout!r} has no layout_source "
                          "(the paper's hardware, or 'reconstructed: why')")  # fmt: skip
    missing = sorted(set(sweep_keys(paper.sweep)) - set(paper.sources)) if paper else []
    if missing:
        raise RecipeError(f"recipe {name}: scales.paper.sources has no source for {missing} (the section/table, or 'reconstructed: why')")
    return recipe


def sweep_keys(sweep: dict) -> list[str]:
    """Every dotted key a sweep sets: its base.set keys and its grid keys (and base.preset as 'preset')."""
    base = sweep.get("base") or {}
    keys = ["preset"] if base.get("preset") else []
    sets = base.get("set") or {}
    keys += [s.split("=", 1)[0] for s in sets] if isinstance(sets, list) else list(sets)
    grids = sweep.get("grid") or []
    for grid in [grids] if isinstance(grids, dict) else grids:
        keys += [k for k in grid if k not in keys]
    return keys


def load_recipe(name: str) -> Recipe:
    """The registered recipe ``name``, validated."""
    try:
        path = Path(RECIPES.get(name))
    except RegistryError as exc:
        raise RecipeError(str(exc)) from None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"recipe {name} ({path}): {exc}") from None
    return parse_recipe(data, name)


def layout_path(name: str) -> Path:
    """The shipped layout ``docs/layouts/NAME.yaml``; a RecipeError when this copy of the harness has none of that name."""
    path = LAYOUTS / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(f"layout {name!r}: no {path} (the layouts ship in the source checkout's docs/layouts)")
    return path


def layout_placement(name: str) -> dict[str, Any]:
    """The placement keys (:data:`PLACEMENT_KEYS`) the layout ``name`` sets, dotted key -> value, in that order."""
    data = yaml.safe_load(layout_path(name).read_text()) or {}
    out = {}
    for key in PLACEMENT_KEYS:
        section, _, field_name = key.partition(".")
        if field_name in (data.get(section) or {}):
            out[key] = data[section][field_name]
    return out


def scale_sweep(recipe: Recipe, scale: str, overrides: list[str] | None = None) -> SweepSpec:
    """The scale's sweep, with id ``<recipe>-<scale>``: its layout's placement keys first (when it names one), then
    base.set, then optional extra ``KEY=VALUE`` overrides."""
    if scale not in recipe.scales:
        raise RecipeError(f"--scale {scale!r}: recipe {recipe.name} has scales {sorted(recipe.scales)}")
    data = json.loads(json.dumps(recipe.scales[scale].sweep))
    base = data.setdefault("base", {})
    layout = recipe.scales[scale].layout
    placement = [f"{k}={json.dumps(v)}" for k, v in layout_placement(layout).items()] if layout else []
    if overrides or placement:
        sets = base.get("set") or {}
        own = list(sets) if isinstance(sets, list) else [f"{k}={json.dumps(v)}" for k, v in sets.items()]
        base["set"] = placement + own + list(overrides or [])
    data["id"] = f"{recipe.name}-{scale}"
    return parse_sweep(data, source=f"recipe {recipe.name} ({scale})")


# ---- planning ---------------------------------------------------------------------------------


def selections(recipe: Recipe, scale: str) -> list[tuple[str, dict[str, Any]]]:
    """Every ``where`` of the recipe's tables, plots and claims at ``scale``, named for messages."""
    out = [(f"table {t.title!r} row {r.label!r}", r.where) for t in recipe.tables for r in on_scale(t.rows, scale)]
    out += [(f"plot {p.title!r} row {r.label!r}", r.where) for p in recipe.plots for r in on_scale(p.rows, scale)]
    for c in recipe.claims:
        out += [(f"claim {c.id} arm {arm.name!r}", arm_where(c, arm, scale)) for arm in claim_arms(c)]
    return out


def on_scale(rows: list[Row], scale: str) -> list[Row]:
    """The rows a scale's grid has."""
    return [r for r in rows if r.scales is None or scale in r.scales]


def arm_where(claim: ClaimSpec, arm: Arm, scale: str | None) -> dict[str, Any]:
    """An arm's selection at a scale: its own ``where`` and the scale design's (the sub-experiment the claim is about)."""
    design = claim.design.get(scale) if scale else None
    return {**arm.where, **(design.where if design else {})}


def claim_arms(claim: ClaimSpec) -> list[Arm]:
    """The claim's arms: candidate, then baseline (absent for a claim against a constant)."""
    return [claim.candidate] + ([claim.baseline] if claim.baseline is not None else [])


def unmatched_selections(recipe: Recipe, points: list, scale: str) -> list[str]:
    """The selections no planned run of the scale matches (a typo in a key or value would leave a row empty)."""
    configs = [p.config.model_dump(mode="json") for p in points]
    return [name for name, where in selections(recipe, scale)
            if not any(all(dotted_get(cfg, k) == v for k, v in where.items()) for cfg in configs)]  # fmt: skip


# ---- a claim compares one thing: its arms' resolved configs --------------------------------------

PAIRING_KEYS = ("seed",)  # arms are compared seed by seed
_MISSING = object()


def resolved_config(cfg: Any) -> dict[str, Any]:
    """A run's full config as dotted key -> value: every field with its default, and the selected method's hyper-parameters
    resolved (defaults filled in) under ``method_args.<method>``; other methods' args, which the run never reads, left out."""
    data = cfg.model_dump(mode="json")
    args = cfg.method_args.get(cfg.method, {})
    try:
        hparams = METHODS.get(cfg.method).hparams.model_validate(args).model_dump(mode="json")
    except (RegistryError, ValidationError):  # planning names a bad method or argument on its own
        hparams = dict(args)
    data["method_args"] = {cfg.method: hparams}
    return flatten(data)


def declared(key: str, prefixes: list[str]) -> bool:
    """Whether ``key`` is one of ``prefixes`` or lies under one."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_diff(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = PAIRING_KEYS) -> list[str]:
    """The dotted keys in which two resolved configs differ (a key one side lacks included), sorted."""
    return sorted(k for k in set(a) | set(b) if k not in ignore and a.get(k, _MISSING) != b.get(k, _MISSING))


def arm_points(points: list, where: dict[str, Any]) -> dict[int, list]:
    """The planned runs an arm's selection picks, by seed."""
    out: dict[int, list] = {}
    for p in points:
        cfg = p.config.model_dump(mode="json")
        if all(dotted_get(cfg, k) == v for k, v in where.items()):
            out.setdefault(int(cfg.get("seed", 0)), []).append(p)
    return out


def _show(value: Any) -> str:
    return "unset" if value is _MISSING else json.dumps(value)


def claim_arms_problem(claim: ClaimSpec, points: list, scale: str | None = None) -> str | None:
    """Why the claim does not compare one thing at this scale (None when it does): an arm that selects runs of one seed
    that differ, or arms whose resolved configs differ in a key outside ``differ_in``. Arms without runs are left to
    :func:`unmatched_selections`."""
    resolved: dict[int, dict[str, Any]] = {}

    def flat(point: Any) -> dict[str, Any]:
        return resolved.setdefault(id(point), resolved_config(point.config))

    by_arm = [(arm, arm_points(points, arm_where(claim, arm, scale))) for arm in claim_arms(claim)]
    for arm, by_seed in by_arm:
        for seed, chosen in sorted(by_seed.items()):
            keys = sorted({k for other in chosen[1:] for k in config_diff(flat(chosen[0]), flat(other))})
            if keys:
                return f"arm {arm.name!r} selects {len(chosen)} runs of seed {seed} that differ in {', '.join(keys)}; narrow its where"
    if len(by_arm) < 2 or not by_arm[0][1] or not by_arm[1][1]:
        return None
    (cand_arm, cand), (base_arm, base) = by_arm
    seeds = sorted(set(cand) & set(base))
    pairs = [(cand[s][0], base[s][0]) for s in seeds] or [(next(iter(cand.values()))[0], next(iter(base.values()))[0])]
    extra: dict[str, tuple[Any, Any]] = {}
    for c, b in pairs:
        fc, fb = flat(c), flat(b)
        for key in config_diff(fc, fb):
            if not declared(key, claim.differ_in):
                extra.setdefault(key, (fc.get(key, _MISSING), fb.get(key, _MISSING)))
    if not extra:
        return None
    shown = "; ".join(f"{k} {_show(a)} vs {_show(b)}" for k, (a, b) in sorted(extra.items()))
    return (f"arms {cand_arm.name!r} and {base_arm.name!r} also differ in {shown} "
            f"(differ_in: {', '.join(claim.differ_in)}): a claim compares one thing")  # fmt: skip


def check_claims(recipe: Recipe, scale: str, points: list) -> None:
    """Refuse (RecipeError, one line) the first claim whose arms differ in more than the keys it declares."""
    for claim in recipe.claims:
        problem = claim_arms_problem(claim, points, scale)
        if problem:
            raise RecipeError(f"recipe {recipe.name} ({scale} scale): claim {claim.id}: {problem}")


# ---- resolvability: what the design can detect, said before running ----------------------------

SIGN_TEST_METRICS = ("samples_per_hour", "step_metric", "eval_metric")
RATE_METRICS = ("final_avg", "eval_metric")  # a mean of 0/1 outcomes over problems x samples: the binomial floor applies


@dataclass
class Resolvability:
    claim: str
    scale: str
    test: str
    alpha: float
    power: float
    seeds: int  # paired seeds the scale plans
    sd: float | None  # the per-seed SD of the paired difference the computation uses
    sd_basis: str  # prior / binomial floor / both
    mde: float | None  # the smallest effect detectable at alpha with the power (inf: none is)
    expected: float | None  # the paper's effect carried to this scale
    threshold: float  # the claim's threshold (margin for '>', -margin for '>=')
    resolvable: bool | None  # None: no effect or no variance stated
    seeds_needed: int | None
    label: str
    assumptions: str

    def to_dict(self) -> dict:
        return asdict(self)


def eval_counts(claim: ClaimSpec, design: Design | None, cfg: Any) -> tuple[int | None, int | None]:
    """(problems, samples per problem) of the claim's evaluation in a planned run: eval.limit and the task's or eval's k,
    else what the design states."""
    task = (design.task if design else None) or claim.task or cfg.task
    k = (cfg.task_args.get(task) or {}).get("k") or cfg.eval.k or (design.k if design else None)
    n = cfg.eval.limit or (design.n_problems if design else None)
    return n, k


def expected_effect(claim: ClaimSpec, scale: str) -> tuple[float | None, float | None]:
    """(the paper's effect carried to this scale, the baseline level there)."""
    design = claim.design.get(scale)
    effect = claim.effect
    level = design.level if design and design.level is not None else (effect.baseline if effect and scale == "paper" else None)
    if effect is None:
        return None, level
    if effect.scaling == "absolute":
        return effect.candidate - effect.baseline, level
    if level is None or effect.baseline == 0:
        return None, level
    return (effect.candidate / effect.baseline - 1.0) * level, level


def resolvability(claim: ClaimSpec, scale: str, points: list) -> Resolvability:
    """The smallest effect the scale's design detects for the claim with the project's paired statistics, and whether the
    paper's effect clears it (:mod:`opd_harness.power`)."""
    design = claim.design.get(scale)
    arms = [arm_points(points, arm_where(claim, arm, scale)) for arm in claim_arms(claim)]
    seeds = len(set(arms[0]) & set(arms[1])) if len(arms) == 2 else len(arms[0])
    sign = claim.metric in SIGN_TEST_METRICS
    test = "exact sign test over seeds" if sign else "paired t-test over seeds"
    threshold = claim_threshold(claim)
    expected, level = expected_effect(claim, scale)
    floor, floor_note = None, ""
    first = next((ps[0] for ps in arms[0].values()), None)
    if claim.metric in RATE_METRICS and level is not None and first is not None:
        n, k = eval_counts(claim, design, first.config)
        if n and k:
            floor = power.binomial_floor(level, expected or 0.0, n, k)
            floor_note = f"binomial floor {floor:.4f} ({n} problems x {k} samples at {level:.3g})"
    prior = design.sd if design else None
    sd = max(x for x in (prior, floor) if x is not None) if (prior is not None or floor is not None) else None
    basis = "prior and binomial floor" if prior is not None and floor is not None else "prior" if prior is not None else "binomial floor"
    mde = None
    if sd is not None:
        mde = (power.mde_sign_test if sign else power.mde_paired_mean)(sd, seeds, claim.alpha, claim.power)
    distance = None if expected is None else expected - threshold
    needed = None
    if sd is not None and distance is not None:
        needed = (power.seeds_sign_test if sign else power.seeds_paired_mean)(sd, distance, claim.alpha, claim.power)
    resolvable: bool | None = None
    if seeds == 0:
        label = "no paired runs of both arms at this scale"
    elif sign and power.sign_test_critical(seeds, claim.alpha) is None:
        resolvable = False
        needs = needed if needed is not None else power.seeds_sign_test(1.0, 10.0, claim.alpha, claim.power)
        label = f"not resolvable at this scale (needs ~{needs} seeds)"
    elif mde is not None and distance is not None:
        resolvable = distance >= mde
        if resolvable:
            label = f"resolvable (detects {mde:.3g}; the paper's effect here {expected:+.3g})"
        elif needed is None:
            label = "not resolvable at this scale (the paper's effect does not clear the claim's threshold)"
        else:
            label = f"not resolvable at this scale (needs ~{needed} seeds)"
    elif mde is not None:
        label = f"detects {mde:.3g} (no paper effect stated to compare)"
    else:
        label = "resolvability not computed (no variance stated)"
    if basis == "binomial floor" and resolvable:
        label += "; floor only, no seed-to-seed SD stated"
    parts = [f"alpha {claim.alpha:g} one-sided, power {claim.power:g}, {seeds} paired seed(s)"]
    if prior is not None:
        parts.append(f"prior sd {prior:.4g} ({design.source})")
    elif design is not None:
        parts.append(f"design: {design.source}")
    if floor_note:
        parts.append(floor_note)
    if sd is not None:
        parts.append(f"sd used {sd:.4g} ({basis})")
    if claim.effect is not None:
        how = f"x level {level:.3g}" if claim.effect.scaling == "relative" and level is not None else claim.effect.scaling
        parts.append(f"paper: {claim.effect.baseline:g} -> {claim.effect.candidate:g} ({claim.effect.source}; {how})")
    return Resolvability(claim.id, scale, test, claim.alpha, claim.power, seeds, sd, basis if sd is not None else "none", mde,
                         expected, threshold, resolvable, needed, label, "; ".join(parts))  # fmt: skip


def resolvability_text(recipe: Recipe, scale: str, points: list) -> list[str]:
    """The dry run's claims section: each claim's arms, what they may differ in, and what the design can resolve."""
    lines = ["claims:"]
    for claim in recipe.claims:
        r = resolvability(claim, scale, points)
        arms = " vs ".join(repr(a.name) for a in claim_arms(claim))
        arms += f" vs the constant {claim.value:g}" if claim.baseline is None else ""
        lines.append(f"  {claim.id}: {claim.text}")
        lines.append(f"    arms: {arms}" + (f"; may differ in: {', '.join(claim.differ_in)}" if claim.differ_in else ""))
        mde = "-" if r.mde is None else "none (no count of seeds reaches alpha)" if math.isinf(r.mde) else f"{r.mde:.4g}"
        expected = "-" if r.expected is None else f"{r.expected:+.4g}"
        lines.append(f"    {r.test}: smallest detectable effect {mde}; the paper's effect here {expected} "
                     f"(threshold {r.threshold:+g}) -> {r.label}")  # fmt: skip
        lines.append(f"    assumes: {r.assumptions}")
    return lines


def plan_text(recipe: Recipe, scale: str, spec: SweepSpec, points: list | None = None) -> str:
    """What ``--dry-run`` prints: the grid, every run (validated and planned), the sources, the resources and, per claim,
    its arms and what the design can resolve."""
    points = expand(spec) if points is None else points
    info = recipe.scales[scale]
    lines = [f"# {recipe.name} ({scale} scale): {recipe.paper.title}" + (f", arXiv {recipe.paper.arxiv}" if recipe.paper.arxiv else "")]
    base = spec.base
    lines.append(f"base: preset={base.preset or '-'}; " + "; ".join(spec.base_overrides()))
    lines.append("grid:")
    lines += [f"  - {json.dumps(g)}" for g in spec.sub_grids()]
    lines.append(f"runs ({len(points)}):")
    lines += [f"  [{p.index}] {p.label()}" for p in points]
    if info.sources:
        lines.append("sources:")
        lines += [f"  {k}: {v}" for k, v in info.sources.items()]
    lines.append(f"resources: {info.resources or 'not stated'}")
    if info.layout:
        lines.append(f"layout: docs/layouts/{info.layout}.yaml ({info.layout_source})")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in layout_placement(info.layout).items()]
    if info.minutes:
        lines.append(f"time: {info.minutes}")
    lines += resolvability_text(recipe, scale, points) if recipe.claims else ["claims: none"]
    lines += [f"warning: {name} matches no run of this scale" for name in unmatched_selections(recipe, points, scale)]
    return "\n".join(lines) + "\n"


# ---- runs in the store ------------------------------------------------------------------------


@dataclass
class StoredRun:
    run_id: str
    status: str
    config: dict


def sweep_runs(store: Store, record: dict) -> list[StoredRun]:
    """The sweep record's runs that exist in the store."""
    out = []
    for point in record.get("points", []):
        stored = store.get_run(point["run_id"]) if point.get("run_id") else None
        if stored is not None:
            out.append(StoredRun(stored["run_id"], stored["status"], stored["config"]))
    return out


def select(runs: list[StoredRun], where: dict[str, Any]) -> dict[int, StoredRun]:
    """Done runs whose config has every ``where`` value, by seed (the first run of a seed wins)."""
    out: dict[int, StoredRun] = {}
    for r in runs:
        if r.status == "done" and all(dotted_get(r.config, k) == v for k, v in where.items()):
            out.setdefault(int(r.config.get("seed", 0)), r)
    return out


def final_matrix(store: Store, run: StoredRun, task: str) -> tuple[list[str], np.ndarray] | None:
    """Problem ids and the (problems, k) score matrix of the run's last evaluated checkpoint on ``task``."""
    curve = run_curve(store, run.run_id, task)
    if not curve:
        return None
    step, _, k = curve[-1]
    scores = sample_scores(store, run.run_id, step, task, k)
    problems = sorted(scores)
    return problems, np.array([scores[p] for p in problems]).reshape(-1, k)


def window_mean(store: Store, run: StoredRun, metric: str, window: int) -> float | None:
    """Mean of a logged step metric over the run's last ``window`` steps that logged it."""
    values = [m[metric] for _, m in sorted(store.step_metrics(run.run_id).items()) if metric in m and m[metric] is not None]
    values = [v for v in values if isinstance(v, int | float) and math.isfinite(v)][-window:]
    return float(np.mean(values)) if values else None


def final_eval_metric(store: Store, run: StoredRun, task: str, metric: str) -> float | None:
    """An evaluation measurement (e.g. ``invalid_tool_rate``) of the run's last evaluated checkpoint on ``task``."""
    rows = [e for e in store.evals(run.run_id) if e["task"] == task]
    value = rows[-1]["metrics"].get(metric) if rows else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def throughput(store: Store, run: StoredRun) -> float | None:
    checkpoints = store.checkpoints(run.run_id)
    return checkpoints[-1]["samples_per_hour"] if checkpoints else None


# ---- claims -----------------------------------------------------------------------------------


@dataclass
class ClaimResult:
    id: str
    text: str
    verdict: str  # holds / does not hold / inconclusive
    test: str
    n_seeds: int
    candidate: float | None  # mean of the candidate's values
    baseline: float | None
    delta: float | None
    ci_low: float | None
    ci_high: float | None
    threshold: float
    p_holds: float | None  # p-value of H0: delta <= threshold
    p_fails: float | None  # p-value of H0: delta >= threshold
    n_problems: int | None = None
    source: str | None = None
    reasons: list[str] = field(default_factory=list)
    resolvability: str | None = None  # the design's label (Resolvability.label), said before running

    def to_dict(self) -> dict:
        return asdict(self)


def claim_threshold(claim: ClaimSpec) -> float:
    return claim.margin if claim.op == ">" else -claim.margin


def paired_seed_test(pairs: list[tuple[np.ndarray, np.ndarray]], threshold: float, alpha: float) -> dict:
    """(candidate, baseline) (problems, k) matrices, one pair per seed: the one-sided paired t-test over seeds of the
    per-seed Avg@k differences. Each seed is one observation, so the test counts the spread between training runs and
    not only the evaluation's noise (each difference carries that), which is the spread the design sizes seeds from.

    NaN (errored/missing) samples count against the candidate for "holds" and for it for "does not hold"; the interval
    is the (1 - 2 alpha) t interval, its low end from the former imputation and its high end from the latter."""
    worst, best = (np.array([np.nan_to_num(c, nan=cn).mean() - np.nan_to_num(b, nan=bn).mean() for c, b in pairs])
                   for cn, bn in ((0.0, 1.0), (1.0, 0.0)))  # fmt: skip
    df = len(pairs) - 1
    critical = float(student_t.ppf(1 - alpha, df))

    def t_score(d: np.ndarray) -> tuple[float, float]:
        """(t statistic of mean(d) against the threshold, standard error); a spread of zero gives +-inf."""
        se = float(d.std(ddof=1)) / np.sqrt(len(d))
        gap = float(d.mean()) - threshold
        return (gap / se if se > 0 else math.copysign(math.inf, gap) if gap else 0.0), se

    t_worst, se_worst = t_score(worst)
    t_best, se_best = t_score(best)
    return {
        "test": "paired t-test over seeds",
        "delta": float(worst.mean()) if np.allclose(worst, best) else None,
        "ci_low": float(worst.mean()) - critical * se_worst,
        "ci_high": float(best.mean()) + critical * se_best,
        "p_holds": float(student_t.sf(t_worst, df)),
        "p_fails": float(student_t.cdf(t_best, df)),
    }


def sign_test(diffs: list[float], threshold: float) -> dict:
    """Exact sign test over seeds of per-seed differences against ``threshold`` (ties dropped)."""
    above = sum(d > threshold for d in diffs)
    below = sum(d < threshold for d in diffs)
    return {
        "test": "exact sign test over seeds",
        "delta": float(np.mean(diffs)),
        "ci_low": float(min(diffs)),
        "ci_high": float(max(diffs)),
        "p_holds": mcnemar_exact_p(above, below),
        "p_fails": mcnemar_exact_p(below, above),
    }


def decide(p_holds: float | None, p_fails: float | None, alpha: float) -> str:
    if p_holds is not None and p_holds < alpha:
        return "holds"
    if p_fails is not None and p_fails < alpha:
        return "does not hold"
    return "inconclusive"


def with_resolvability(result: ClaimResult, design: Resolvability) -> ClaimResult:
    """A claim the design cannot resolve is reported with that label, whatever the test reads (never as weak evidence):
    the test's own reading moves to the reasons."""
    result.resolvability = design.label
    if design.resolvable is False:
        result.reasons.append(f"the test alone reads '{result.verdict}'; the design cannot resolve the paper's effect, so this is "
                              "no evidence either way")  # fmt: skip
        result.verdict = design.label
    return result


def evaluate_claim(
    store: Store, runs: list[StoredRun], claim: ClaimSpec, scale: str | None = None
) -> ClaimResult:
    """One claim over the sweep's done runs, paired by seed (and by problem for final_avg); at ``scale`` its design's
    ``where`` narrows both arms and its ``task`` (else the claim's, else each run's training task) is evaluated."""
    design = claim.design.get(scale) if scale else None
    claim = claim.model_copy(update={"task": design.task}) if design and design.task else claim
    threshold = claim_threshold(claim)
    cand = select(runs, arm_where(claim, claim.candidate, scale))
    base = select(runs, arm_where(claim, claim.baseline, scale)) if claim.baseline is not None else None
    seeds = sorted(set(cand) & set(base)) if base is not None else sorted(cand)
    result = ClaimResult(claim.id, claim.text, "inconclusive", "", len(seeds), None, None, None, None, None, threshold, None, None,
                         source=claim.source)  # fmt: skip
    if len(seeds) < claim.min_seeds:
        result.reasons.append(f"{len(seeds)} paired seed(s) with done runs (needs {claim.min_seeds})")
        return result
    if claim.metric == "final_avg":
        pairs, reasons, n_problems = [], [], 0
        for s in seeds:
            task = claim.task or cand[s].config["task"]
            c = final_matrix(store, cand[s], task)
            b = final_matrix(store, base[s], task) if base is not None else None
            if c is None or (base is not None and b is None):
                reasons.append(f"seed {s}: no evaluation of {task}")
                continue
            if b is None:  # a constant: a matrix of it on the candidate's problems
                b = (c[0], np.full(c[1].shape, float(claim.value)))
            problems = sorted(set(c[0]) | set(b[0]))
            k = min(c[1].shape[1], b[1].shape[1])
            cm, bm = dict(zip(c[0], c[1][:, :k])), dict(zip(b[0], b[1][:, :k]))
            gap = np.full(k, np.nan)
            pairs.append((np.array([cm.get(p, gap) for p in problems]), np.array([bm.get(p, gap) for p in problems])))
            n_problems = max(n_problems, len(problems))
        result.reasons += reasons
        if len(pairs) < max(claim.min_seeds, 2):
            if len(pairs) == 1:
                result.reasons.append("one paired seed: the t-test over seeds needs two")
            return result
        stats = paired_seed_test(pairs, threshold, claim.alpha)
        result.n_seeds, result.n_problems = len(pairs), n_problems
        result.candidate = float(np.mean([np.nanmean(c) for c, _ in pairs]))
        result.baseline = float(np.mean([np.nanmean(b) for _, b in pairs]))
    else:
        def value(run: StoredRun) -> float | None:
            if claim.metric == "samples_per_hour":
                return throughput(store, run)
            if claim.metric == "eval_metric":
                return final_eval_metric(store, run, claim.task or run.config["task"], claim.step_metric or "")
            return window_mean(store, run, claim.step_metric or "", claim.window)

        cv = {s: value(cand[s]) for s in seeds}
        bv = {s: (value(base[s]) if base is not None else claim.value) for s in seeds}
        ok = [s for s in seeds if cv[s] is not None and bv[s] is not None]
        if len(ok) < claim.min_seeds:
            result.reasons.append(f"{claim.metric} recorded for {len(ok)} paired seed(s) (needs {claim.min_seeds})")
            return result
        stats = sign_test([cv[s] - bv[s] for s in ok], threshold)
        result.n_seeds = len(ok)
        result.candidate, result.baseline = float(np.mean([cv[s] for s in ok])), float(np.mean([bv[s] for s in ok]))
    result.test, result.delta = stats["test"], stats["delta"] if stats["delta"] is not None else result.candidate - result.baseline
    result.ci_low, result.ci_high, result.p_holds, result.p_fails = stats["ci_low"], stats["ci_high"], stats["p_holds"], stats["p_fails"]
    result.verdict = decide(result.p_holds, result.p_fails, claim.alpha)
    if result.verdict == "inconclusive" and result.test.startswith("exact sign"):
        best = 0.5 ** result.n_seeds
        if best >= claim.alpha:
            result.reasons.append(f"{result.n_seeds} seeds: the sign test cannot reach p < {claim.alpha:g} (smallest p {best:.3f})")
    return result


# ---- tables and plots -------------------------------------------------------------------------


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{np.mean(xs):.3f}" + (f" ± {np.std(xs, ddof=1):.3f}" if len(xs) > 1 else "")


ArmRuns = list[tuple[str, str, set[str]]]  # (claim id, arm name, the done runs it selects)
REFERENCE = "reference (not in a claim)"


def claim_arm_runs(recipe: Recipe, runs: list[StoredRun], scale: str) -> ArmRuns:
    """Every claim arm with the done runs it selects at ``scale``."""
    return [(c.id, arm.name, {r.run_id for r in select(runs, arm_where(c, arm, scale)).values()})
            for c in recipe.claims for arm in claim_arms(c)]  # fmt: skip


def role(run_ids: set[str], arms: ArmRuns) -> str:
    """A table row's part in the claims: the claim arms whose runs hold all of its runs, else a reference row."""
    if not run_ids:
        return "-"
    return "; ".join(f"{claim}: {arm}" for claim, arm, ids in arms if run_ids <= ids) or REFERENCE


def matching_ids(runs: list[StoredRun], where: dict[str, Any]) -> set[str]:
    return {r.run_id for r in runs if r.status == "done" and all(dotted_get(r.config, k) == v for k, v in where.items())}


def per_task_table(store: Store, runs: list[StoredRun], spec: TableSpec, arms: ArmRuns | None = None) -> str:
    """Final Avg@k per task (mean ± std over seeds), each domain's macro average, and the overall macro."""
    groups = spec.groups or {}
    head = ["row", "role", "seeds", *spec.tasks, *(f"{g} (macro)" for g in groups), "Macro"]
    lines = [f"### {spec.title}", *([f"_{spec.source}_", ""] if spec.source else [""]),
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for row in spec.rows:
        chosen = select(runs, row.where)
        per_task: dict[str, list[float]] = {}
        for run in chosen.values():
            for task in spec.tasks:
                curve = run_curve(store, run.run_id, task)
                if curve:
                    per_task.setdefault(task, []).append(curve[-1][1])
        means = {t: float(np.mean(v)) for t, v in per_task.items()}
        cells = [row.label, role(matching_ids(runs, row.where), arms or []), str(len(chosen)),
                 *(_mean_std(per_task.get(t, [])) for t in spec.tasks)]  # fmt: skip
        for tasks in groups.values():
            cells.append(_f(float(np.mean([means[t] for t in tasks]))) if all(t in means for t in tasks) else "-")
        cells.append(_f(float(np.mean(list(means.values())))) if len(means) == len(spec.tasks) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_metrics_table(store: Store, runs: list[StoredRun], spec: TableSpec, arms: ArmRuns | None = None) -> str:
    """Each logged metric's mean over the last ``window`` steps (mean over seeds)."""
    head = ["row", "role", "seeds", *spec.metrics]
    lines = [f"### {spec.title} (mean of the last {spec.window} steps)", *([f"_{spec.source}_", ""] if spec.source else [""]),
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for row in spec.rows:
        chosen = select(runs, row.where)
        cells = [row.label, role(matching_ids(runs, row.where), arms or []), str(len(chosen))]
        for metric in spec.metrics:
            values = [v for r in chosen.values() if (v := window_mean(store, r, metric, spec.window)) is not None]
            cells.append(_mean_std(values))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def with_roles(report: dict, arms: ArmRuns) -> dict:
    """A sweep report whose rows carry a ``role`` column (claim arms, or a reference row outside every claim)."""
    rows = [{**row, "role": role(set(row["run_ids"]), arms)} for row in report["rows"]]
    return {**report, "rows": rows, "grid_keys": [*report["grid_keys"], "role"]}


def plot_curves(store: Store, runs: list[StoredRun], spec: PlotSpec, path: Path) -> Path | None:
    """One line per row (mean over seeds by step) of a step metric or a task's Avg@k, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    drawn = 0
    for row in spec.rows:
        by_step: dict[int, list[float]] = {}
        for run in select(runs, row.where).values():
            if spec.kind == "avg_vs_step":
                points = [(s, a) for s, a, _ in run_curve(store, run.run_id, spec.metric or run.config["task"])]
            else:
                points = [(s, m[spec.metric]) for s, m in store.step_metrics(run.run_id).items() if spec.metric in m]
            for s, v in points:
                if isinstance(v, int | float) and math.isfinite(v):
                    by_step.setdefault(s, []).append(v)
        if by_step:
            steps = sorted(by_step)
            ax.plot(steps, [np.mean(by_step[s]) for s in steps], label=row.label)
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(spec.metric if spec.kind == "step_metric" else f"Avg@k ({spec.metric or 'training task'})")
    ax.set_title(spec.title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def claims_markdown(results: list[ClaimResult]) -> str:
    lines = ["### Claims", "", "| claim | verdict | candidate | baseline | delta | interval | p (holds) | seeds | test |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        interval = f"[{_f(r.ci_low)}, {_f(r.ci_high)}]" if r.ci_low is not None else "-"
        lines.append(f"| {r.id}: {r.text} | **{r.verdict}** | {_f(r.candidate)} | {_f(r.baseline)} | {_f(r.delta)} | {interval} | "
                     f"{_f(r.p_holds)} | {r.n_seeds} | {r.test or '-'} |")  # fmt: skip
    notes = [f"- {r.id}: {'; '.join(r.reasons)}" for r in results if r.reasons]
    notes += [f"- {r.id}: design: {r.resolvability}" for r in results if r.resolvability and not r.verdict.startswith(NOT_RESOLVABLE)]
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    unresolvable = [r.id for r in results if r.verdict.startswith(NOT_RESOLVABLE)]
    held = [r.id for r in results if r.verdict == "holds"]
    lines += ["", *notes, *([""] if notes else []),
              f"{counts['holds']} of {len(results)} claims held ({', '.join(held) or 'none'}), {counts['does not hold']} did not hold, "
              f"{counts['inconclusive']} inconclusive"
              + (f", {len(unresolvable)} not resolvable at this scale ({', '.join(unresolvable)})." if unresolvable else ".")]  # fmt: skip
    return "\n".join(lines) + "\n"


@dataclass
class Reproduction:
    recipe: str
    scale: str
    sweep_id: str
    markdown: str
    claims: list[ClaimResult]
    folder: Path
    plots: list[Path]
    failed: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # points another process was running: not in the tables yet


def render(
    recipe: Recipe, scale: str, out: Path, designs: dict[str, Resolvability] | None = None
) -> Reproduction:
    """Tables, plots and claims of a recipe's scale from the store under ``out``; written to ``out/reproduce/<id>/``.
    ``designs``: each claim's resolvability at this scale (:func:`resolvability`), which labels the claims it cannot resolve."""
    sweep_id = f"{recipe.name}-{scale}"
    record = load_sweep_record(out, sweep_id)
    folder = out / "reproduce" / sweep_id
    parts = [f"## {recipe.paper.title} — {scale} scale (`{sweep_id}`)", ""]
    plots: list[Path] = []
    with Store(out) as store:
        runs = sweep_runs(store, record)
        arms = claim_arm_runs(recipe, runs, scale)
        done = sum(r.status == "done" for r in runs)
        parts.append(f"{done} of {len(record.get('points', []))} runs done.\n")
        for spec in recipe.tables:
            if spec.kind == "sweep":
                parts.append(f"### {spec.title}\n" + (f"_{spec.source}_\n" if spec.source else "") + "\n"
                             + render_markdown(with_roles(sweep_report(store, record), arms)).split("\n", 1)[1])  # fmt: skip
            elif spec.kind == "per_task":
                parts.append(per_task_table(store, runs, spec.model_copy(update={"rows": on_scale(spec.rows, scale)}), arms))
            else:
                parts.append(step_metrics_table(store, runs, spec.model_copy(update={"rows": on_scale(spec.rows, scale)}), arms))
        for i, spec in enumerate(recipe.plots):
            scaled = spec.model_copy(update={"rows": on_scale(spec.rows, scale)})
            path = plot_curves(store, runs, scaled, folder / f"plot_{i}_{spec.kind}.png")
            if path is not None:
                plots.append(path)
                parts.append(f"![{spec.title}]({path.name})\n")
        claims = [evaluate_claim(store, runs, c, scale) for c in recipe.claims]
        claims = [with_resolvability(r, designs[r.id]) if designs and r.id in designs else r for r in claims]
    parts.append(claims_markdown(claims))
    markdown = "\n".join(parts)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.md").write_text(markdown)
    (folder / "claims.json").write_text(json.dumps([c.to_dict() for c in claims], indent=2) + "\n")
    return Reproduction(recipe.name, scale, sweep_id, markdown, claims, folder, plots)


def reproduce(
    name: str, scale: str, out: str | Path, *, dry_run: bool = False, overrides: list[str] | None = None, console: Console | None = None
) -> Reproduction | str:
    """Run (or with ``dry_run`` plan) the registered recipe ``name`` at ``scale``; see :func:`run_recipe`."""
    return run_recipe(load_recipe(name), scale, out, dry_run=dry_run, overrides=overrides, console=console)


def run_recipe(
    recipe: Recipe, scale: str, out: str | Path, *, dry_run: bool = False, overrides: list[str] | None = None,
    console: Console | None = None,
) -> Reproduction | str:
    """Run a recipe's scale through the sweep machinery (resumable), then render it; ``dry_run`` returns the plan text."""
    spec = scale_sweep(recipe, scale, overrides)
    points = expand(spec)
    check_claims(recipe, scale, points)
    if dry_run:
        return plan_text(recipe, scale, spec, points)
    designs = {c.id: resolvability(c, scale, points) for c in recipe.claims}
    out = Path(out)
    result = run_sweep(spec, out, console=console or Console(stderr=True))
    rendered = render(recipe, scale, out, designs)
    rendered.failed, rendered.elsewhere = list(result.failed), list(result.elsewhere)
    return rendered


def distinct_plans(recipe: Recipe, scale: str, overrides: list[str] | None = None) -> list[tuple[Any, int]]:
    """The scale's runs grouped by what a run's dry run checks (models, method, task, mode and placement): (the first
    run of each group, how many runs it stands for), in grid order. Each run is validated and planned, nothing run."""
    groups: dict[str, list] = {}
    for point in expand(scale_sweep(recipe, scale, overrides)):
        cfg = point.config
        models = [getattr(cfg, role).model_dump(mode="json", exclude={"seed"}) for role in ("student", "teacher")]
        trainer = cfg.trainer.model_dump(mode="json", exclude={"steps"})
        key = json.dumps([*models, cfg.method, cfg.task, cfg.eval.tasks, trainer], sort_keys=True)
        groups.setdefault(key, []).append(point)
    return [(points[0], len(points)) for points in groups.values()]
