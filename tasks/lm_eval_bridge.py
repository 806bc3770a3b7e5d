"""Any lm-evaluation-harness task as a harness task: ``harness eval --task lm_eval:<lm-eval task name>``.

lm-eval builds the prompts (its fully built context: description, few-shot examples and the doc) and
scores the outputs (its filters and ``process_results``); our backends generate, so hf, openai, replay
and vllm all work, and results land in the store like any task's (per-sample rows, Avg@k, CI).

* Problems: one per lm-eval doc of the task's evaluation split (test, else validation); id = lm-eval's
  ``doc_id`` as a string; ``question`` = the built context; ``meta["doc"]`` keeps the doc for grading.
* ``generate_until``: generation honours ``generation_kwargs``: ``until`` strings are passed as stop strings
  and the completion is cut at the first one before grading (as lm-eval's HF model does); ``max_gen_toks``
  is the default ``max_new_tokens``. The sampling temperature is ``harness eval --temperature`` (lm-eval's
  tasks are mostly greedy: pass ``--temperature 0`` to match them).
* ``multiple_choice`` and ``loglikelihood``: the continuations are scored with ``Backend.score`` (hf,
  vllm); the completion of a multiple-choice sample is the chosen choice's text (argmax log-likelihood,
  length-normalised for ``acc_norm``/``acc_bytes``), of a loglikelihood sample the greedy continuation.
  With the replay backend those completions are read from its file instead.
* Grading: every filter pipeline of the task and ``process_results`` run on each sample on its own
  (lm-eval ``repeats`` become our k samples); the primary metric (first of ``metric_list``, or option
  ``metric``) under the primary filter (first of ``filter_list``, or option ``filter``) maps to the
  tri-state score: 1/True pass, 0/False fail, an exception in lm-eval's scoring (or a value that is not
  0/1) error. Every metric of every filter goes into the score's details (JSON).

Options (``--task-arg lm_eval:NAME.KEY=VALUE``): ``include_path`` (a directory of lm-eval YAMLs, several
joined with ``os.pathsep``; default ``$HARNESS_LM_EVAL_INCLUDE``; when set, lm-eval's built-in tasks are
not indexed unless ``include_defaults=true``), ``num_fewshot``, ``limit``, ``metric``, ``filter``,
``apply_chat_template`` and ``fewshot_seed`` (lm-eval's default 1234). lm-eval is imported lazily, so
``harness tasks`` works without it; its datasets cache defaults to ``<harness cache>/hf_datasets``.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from opd_harness.episode import SingleTurnEnv
from opd_harness.task import Problem, Score, Task, TaskOptions

PREFIX = "lm_eval"
INCLUDE_ENV = "HARNESS_LM_EVAL_INCLUDE"
LM_EVAL_DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF model default when a task sets no max_gen_toks
SUPPORTED_OUTPUT_TYPES = ("generate_until", "multiple_choice", "loglikelihood")
CHOICE_METRICS = ("acc", "acc_norm", "acc_bytes")  # how the chosen choice is picked, per primary metric
SCORE_BATCH = 16  # sequences per Backend.score call
NOT_CHOSEN = -1e30  # log-likelihood given to the choices the model did not pick, when re-grading a choice


def LmEvalError(message: str) -> Exception:  # noqa: N802 - used as `raise LmEvalError(...)`
    """An lm-eval task that cannot be used (unknown name, unsupported type, data not loadable): a ConfigError, exit code 2.

    Built lazily: ``opd_harness.config`` imports torch, and this module is imported by ``harness tasks``.
    """
    from opd_harness.config import ConfigError

    return ConfigError(message)


class LmEvalOptions(TaskOptions):
    k: int = Field(1, ge=1, description="samples per problem; default: the task's `repeats`")
    max_new_tokens: int = Field(LM_EVAL_DEFAULT_MAX_GEN_TOKS, ge=1, description="default: the task's generation_kwargs.max_gen_toks")
    use_chat_template: bool = Field(False, description="alias of apply_chat_template")
    include_path: str | None = Field(None, description=f"directory of lm-eval task YAMLs (os.pathsep-separated); default ${INCLUDE_ENV}")
    include_defaults: bool | None = Field(None, description="also index lm-eval's built-in tasks; default: only when no include_path")
    num_fewshot: int | None = Field(None, ge=0, description="override the task's num_fewshot (a task that fixes 0 keeps 0)")
    metric: str | None = Field(None, description="primary metric; default: the first of the task's metric_list")
    filter: str | None = Field(None, description="primary filter pipeline; default: the first of the task's filter_list")
    apply_chat_template: bool = Field(False, description="build prompts with the model's chat template, as lm-eval --apply_chat_template")
    fewshot_seed: int = Field(1234, description="seed of lm-eval's few-shot sampler (lm-eval's default 1234)")


@dataclass(frozen=True)
class DocRequests:
    """One lm-eval doc with its request arguments (one tuple per request, in lm-eval's ``idx`` order)."""

    doc_id: int
    doc: dict
    arguments: list[tuple]

    @property
    def context(self) -> str:
        return self.arguments[0][0]


# --------------------------------------------------------------------------- lm-eval loading


def include_paths(option: str | None) -> list[str]:
    """The include directories from the option, else ``$HARNESS_LM_EVAL_INCLUDE``; each must exist."""
    raw = option if option else os.environ.get(INCLUDE_ENV, "")
    paths = [str(Path(p).expanduser()) for p in raw.split(os.pathsep) if p.strip()]
    for path in paths:
        if not Path(path).is_dir():
            where = "include_path" if option else f"${INCLUDE_ENV}"
            raise LmEvalError(f"{where}: {path!r} is not a directory of lm-eval task YAMLs")
    return paths


def _configure_environment() -> None:
    """Datasets cache under the harness cache (unless the user chose one), quiet lm-eval and datasets logs."""
    if not os.environ.get("HF_HOME") and not os.environ.get("HF_DATASETS_CACHE"):
        from opd_harness.tasks.code.common import cache_root

        os.environ["HF_DATASETS_CACHE"] = str(cache_root() / "hf_datasets")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def _import_lm_eval():
    """``lm_eval.tasks.TaskManager``, with a clear error when lm-eval is missing."""
    _configure_environment()
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise LmEvalError(f"lm_eval:* tasks need lm-evaluation-harness: pip install 'opd-harness[lmeval]' ({exc})") from None
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    return TaskManager


_MANAGERS: dict[tuple[tuple[str, ...], bool], Any] = {}


def task_manager(paths: list[str], include_defaults: bool):
    """A cached lm-eval TaskManager (indexing lm-eval's built-in tasks takes seconds)."""
    key = (tuple(paths), include_defaults)
    if key not in _MANAGERS:
        TaskManager = _import_lm_eval()
        with _quiet():
            _MANAGERS[key] = TaskManager(include_path=paths or None, include_defaults=include_defaults)
    return _MANAGERS[key]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Swallow lm-eval's progress bars and prints (they write to stdout/stderr; our --json owns stdout)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def load_lm_eval_task(name: str, paths: list[str], include_defaults: bool):
    """The lm-eval Task object called ``name``; unknown names, groups and unloadable data are clear errors."""
    manager = task_manager(paths, include_defaults)
    searched = f"include path {os.pathsep.join(paths)}" if paths else "lm-eval's built-in tasks"
    if include_defaults and paths:
        searched += " and lm-eval's built-in tasks"
    if name not in manager.all_tasks:
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        extra = "" if paths else f" (a directory of task YAMLs: --task-arg {PREFIX}:{name}.include_path=DIR or ${INCLUDE_ENV})"
        raise LmEvalError(f"unknown lm-eval task {name!r} in {searched}.{hint}{extra}")
    try:
        with _quiet():
            loaded = manager.load(name)
    except Exception as exc:  # noqa: BLE001 - dataset download/parse failures of every kind
        offline = isinstance(exc, OSError) or "hub" in str(exc).lower()
        hint = (
            ". Offline, copy its YAML into an include_path and point it at local files (dataset_path: json, dataset_kwargs.data_files)"
            if offline
            else ""
        )
        raise LmEvalError(f"lm-eval task {name!r}: could not build it or load its data ({type(exc).__name__}: {exc}){hint}") from None
    tasks = loaded["tasks"]
    if len(tasks) != 1:
        listed = ", ".join(f"{PREFIX}:{t}" for t in sorted(tasks))
        raise LmEvalError(f"lm-eval name {name!r} is a group or tag of {len(tasks)} tasks; evaluate them one by one: --task {listed}")
    return next(iter(tasks.values()))


# --------------------------------------------------------------------------- the task


class LmEvalTask(Task):
    """Base of the per-name classes built by the ``lm_eval:`` prefix factory."""

    lm_eval_name: ClassVar[str]
    Options = LmEvalOptions

    def __init__(self, options: TaskOptions | None = None) -> None:
        super().__init__(options)
        opts: LmEvalOptions = self.options  # type: ignore[assignment]
        paths = include_paths(opts.include_path)
        defaults = opts.include_defaults if opts.include_defaults is not None else not paths
        self.lm = load_lm_eval_task(self.lm_eval_name, paths, defaults)
        self.output_type: str = self.lm.OUTPUT_TYPE
        if self.output_type not in SUPPORTED_OUTPUT_TYPES:
            raise LmEvalError(
                f"lm-eval task {self.lm_eval_name!r} has output_type {self.output_type!r}, which the bridge does not support "
                f"(supported: {', '.join(SUPPORTED_OUTPUT_TYPES)})"
            )
        if getattr(self.lm, "multiple_input", 0):
            raise LmEvalError(
                f"lm-eval task {self.lm_eval_name!r} puts its choices in the context (multiple inputs); the bridge does not support that"
            )
        self._set_fewshot(opts.num_fewshot)
        self.filters: list = list(getattr(self.lm, "_filters", None) or [])
        self.filter_name = self._pick("filter", opts.filter, [f.name for f in self.filters])
        self.metric = self._pick("metric", opts.metric, list(getattr(self.lm, "_metric_fn_list", None) or {}))
        if self.output_type == "multiple_choice" and self.metric not in CHOICE_METRICS:
            raise LmEvalError(
                f"lm-eval task {self.lm_eval_name!r} (multiple_choice): metric {self.metric!r} is not supported; "
                f"choose one of {', '.join(CHOICE_METRICS)}"
            )
        if self.output_type == "loglikelihood" and self.metric != "acc":
            raise LmEvalError(
                f"lm-eval task {self.lm_eval_name!r} (loglikelihood): only metric 'acc' (is the target the greedy continuation) "
                f"is supported, not {self.metric!r}"
            )
        self.gen_kwargs: dict = dict(self.lm.config.generation_kwargs or {})
        self.until: tuple[str, ...] = tuple(s for s in _as_list(self.gen_kwargs.get("until")) if s)
        self.options = opts.model_copy(update=self._defaults_from_task(opts))
        self._requests: dict[int | None, dict[str, DocRequests]] = {}
        self._loglikelihoods: dict[str, list[float]] = {}

    def _set_fewshot(self, num_fewshot: int | None) -> None:
        """As lm-eval's simple_evaluate: the option overrides the task's count, an unset count becomes 0.

        lm-eval silently ignores an override of a task that fixes ``num_fewshot: 0``; here that is an error.
        """
        configured = self.lm.get_config("num_fewshot")
        if num_fewshot is not None and num_fewshot != 0 and configured == 0:
            raise LmEvalError(
                f"lm-eval task {self.lm_eval_name!r} fixes num_fewshot: 0 in its config (lm-eval ignores overrides of it); drop num_fewshot"
            )
        if num_fewshot is not None:
            self.lm.set_config(key="num_fewshot", value=num_fewshot)
        elif configured is None:
            self.lm.set_config(key="num_fewshot", value=0)

    def _pick(self, what: str, chosen: str | None, available: list[str]) -> str:
        """The chosen filter/metric, or the task's first; an unknown one lists what the task has."""
        if not available:
            raise LmEvalError(f"lm-eval task {self.lm_eval_name!r} defines no {what}")
        if chosen is None:
            return available[0]
        if chosen not in available:
            raise LmEvalError(f"lm-eval task {self.lm_eval_name!r} has no {what} {chosen!r}; it has: {', '.join(available)}")
        return chosen

    def _defaults_from_task(self, opts: LmEvalOptions) -> dict:
        """k from the task's ``repeats`` and max_new_tokens from its ``max_gen_toks``, unless set by the user."""
        update: dict = {}
        repeats = self.lm.get_config("repeats")
        if "k" not in opts.model_fields_set and isinstance(repeats, int) and repeats > 1:
            update["k"] = repeats
        if "max_new_tokens" not in opts.model_fields_set and self.gen_kwargs.get("max_gen_toks"):
            update["max_new_tokens"] = int(self.gen_kwargs["max_gen_toks"])
        return update

    @property
    def chat(self) -> bool:
        """Prompts go through the model's chat template (apply_chat_template, or its alias use_chat_template)."""
        opts: LmEvalOptions = self.options  # type: ignore[assignment]
        return opts.apply_chat_template or opts.use_chat_template

    def provided_inputs(self) -> frozenset[str]:
        """Rewards, and reference responses for generation tasks (their gold target is the solution, see ``_problem``)."""
        refs = frozenset({"reference_responses"}) if self.output_type == "generate_until" else frozenset()
        return (super().provided_inputs() - {"reference_responses"}) | refs

    # ---- problems and prompts

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        """One Problem per lm-eval doc (first ``limit`` docs: lm-eval builds only those), with lm-eval's plain (no chat
        template) context; lm-eval reads its own data (``data_dir`` is unused)."""
        return [self._problem(r) for r in self.requests(None).values()]

    def _problem(self, r: DocRequests) -> Problem:
        gold = self.gold_text(r)
        solution = gold if self.output_type == "generate_until" else None
        return Problem(id=str(r.doc_id), question=r.context, answer=gold, solution=solution, meta={"doc_id": r.doc_id, "doc": r.doc})

    def gold_text(self, r: DocRequests) -> str:
        """The gold as text: the target continuation, the gold choice(s), or the generation target."""
        if self.output_type == "loglikelihood":
            return r.arguments[0][1]
        target = self.lm.doc_to_target(r.doc)
        if self.output_type == "multiple_choice" or self.lm.config.doc_to_choice is not None:
            choices = self.lm.doc_to_choice(r.doc)
            pick = lambda t: choices[t] if isinstance(t, int) and 0 <= t < len(choices) else str(t)  # noqa: E731
            return " | ".join(pick(t) for t in target) if isinstance(target, list) else pick(target)
        return " | ".join(map(str, target)) if isinstance(target, list) else str(target)

    def requests(self, tokenizer) -> dict[str, DocRequests]:
        """doc id -> requests, built by lm-eval exactly as its evaluator does (same few-shot seed and order).

        ``tokenizer`` is used only with ``apply_chat_template`` (the contexts then depend on its template).
        """
        key = id(tokenizer) if self.chat and tokenizer is not None else None
        if key not in self._requests:
            self._requests[key] = self._build_requests(tokenizer if key is not None else None)
        return self._requests[key]

    def _build_requests(self, tokenizer) -> dict[str, DocRequests]:
        opts: LmEvalOptions = self.options  # type: ignore[assignment]
        kwargs: dict = {}
        if tokenizer is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"{self.name}: apply_chat_template is set but the model's tokenizer has no chat template")
            kwargs = {
                "apply_chat_template": True,
                "chat_template": partial(render_chat, tokenizer),
                "tokenizer_name": getattr(tokenizer, "name_or_path", ""),
            }
        self.lm.set_fewshot_seed(seed=opts.fewshot_seed)
        with _quiet():
            self.lm.build_all_requests(limit=opts.limit, **kwargs)
        grouped: dict[int, list] = {}
        for inst in self.lm.instances:
            grouped.setdefault(inst.doc_id, []).append(inst)
        out: dict[str, DocRequests] = {}
        for doc_id, insts in grouped.items():
            insts.sort(key=lambda i: i.idx)
            out[str(doc_id)] = DocRequests(doc_id, insts[0].doc, [tuple(i.arguments) for i in insts])
        return out

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        """lm-eval's built context for the doc (with the model's chat template when apply_chat_template)."""
        if not self.chat:
            return problem.question
        return self.requests(tokenizer)[problem.id].context

    # ---- generation / scoring

    def rollout(self, backend, problems: list[Problem], params) -> list:
        """Generation with the task's stop strings, or scoring of the continuations (multiple choice, loglikelihood)."""
        from opd_harness.rollout import run_episodes

        if self.output_type == "generate_until" or getattr(backend, "needs_episode_keys", False):
            return run_episodes(backend, self, problems, params)  # the shared episode loop; stop strings from env()
        return self._scored_rollout(backend, problems, params.n)

    def env(self, problem: Problem, tokenizer) -> SingleTurnEnv:
        """One generation turn that stops at the task's ``until`` strings."""
        return SingleTurnEnv(self.format_prompt(problem, tokenizer), stop=tuple(self.until))

    def _scored_rollout(self, backend, problems: list[Problem], n: int) -> list:
        """Score every (context, continuation) with ``backend.score`` and turn each doc's pick into ``n`` trajectories."""
        from opd_harness.rollout import encode
        from opd_harness.trajectory import Segment, Trajectory

        tokenizer = backend.tokenizer
        reqs = self.requests(tokenizer)
        pairs = [(p.id, ctx, cont) for p in problems for ctx, cont in reqs[p.id].arguments]
        started = time.perf_counter()
        scored = score_continuations(backend, [(ctx, cont) for _, ctx, cont in pairs])
        per_doc: dict[str, list[tuple[float, bool, str]]] = {}
        for (pid, _, _), result in zip(pairs, scored, strict=True):
            per_doc.setdefault(pid, []).append(result)
        seconds = (time.perf_counter() - started) / max(len(problems) * n, 1)
        out = []
        for p in problems:
            r = reqs[p.id]
            completion = self._pick_completion(r, per_doc[p.id])
            self._loglikelihoods[p.id] = [ll for ll, _, _ in per_doc[p.id]]
            ids = encode(tokenizer, completion)
            for s in range(n):
                segment = Segment(
                    kind="model", token_ids=list(ids), text=completion, step=0, policy_version=backend.version, finish_reason="stop"
                )
                traj = Trajectory(
                    task=self.name,
                    problem_id=p.id,
                    sample_index=s,
                    prompt_ids=encode(tokenizer, r.context),
                    prompt_text=r.context,
                    segments=[segment],
                )
                traj.timings["generate_s"] = seconds
                out.append(traj)
        return out

    def _pick_completion(self, r: DocRequests, results: list[tuple[float, bool, str]]) -> str:
        """Multiple choice: the argmax choice under the primary metric's normalisation; loglikelihood: the greedy text."""
        if self.output_type == "loglikelihood":
            _, greedy, text = results[0]
            return r.arguments[0][1] if greedy else text
        choices = self.lm.doc_to_choice(r.doc)
        lls = [ll for ll, _, _ in results][: len(choices)]
        if self.metric == "acc_norm":
            lls = [ll / max(len(c), 1) for ll, c in zip(lls, choices)]
        elif self.metric == "acc_bytes":
            lls = [ll / max(len(c.encode("utf-8")), 1) for ll, c in zip(lls, choices)]
        return choices[max(range(len(lls)), key=lambda i: (lls[i], -i))]  # first index on ties, as np.argmax

    # ---- grading

    def grade_many(self, problems: list[Problem], completions: list[str]) -> list[Score]:
        """lm-eval's filters and process_results per sample; the primary (filter, metric) gives the status."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        items: list[tuple[Problem, list]] = []
        prepared: list[str | None] = []
        for problem, completion in zip(problems, completions):
            results, why = self._results(problem, completion)
            items.append((problem, self._instances(problem, results)))
            prepared.append(why)
        filtered, filter_errors = self._apply_filters([insts for _, insts in items])
        return [
            self._score(p, insts, filtered[i], filter_errors[i], prepared[i], c)
            for i, ((p, insts), c) in enumerate(zip(items, completions))
        ]

    def _results(self, problem: Problem, completion: str) -> tuple[list, str | None]:
        """The per-request model results lm-eval would have produced for this completion (and a note)."""
        if self.output_type == "generate_until":
            return [truncate_at_stop(completion, self.until)], None
        if self.output_type == "loglikelihood":
            return [(0.0, completion == problem.answer)], None
        choices = self.lm.doc_to_choice(problem.meta["doc"])
        picked = completion if completion in choices else completion.strip()
        note = None if picked in choices else f"completion is none of the {len(choices)} choices"
        results = [(0.0 if c == picked else NOT_CHOSEN, c == picked) for c in choices]
        if "acc_mutual_info" in getattr(self.lm, "_metric_fn_list", {}):  # unconditional scores, neutral for the pick
            results += [(0.0, False)] * len(choices)
        return results, note

    def _instances(self, problem: Problem, results: list) -> list:
        """lm-eval Instances for one sample, one per request, each holding its single response."""
        from lm_eval.api.instance import Instance

        request_type = "loglikelihood" if self.output_type == "multiple_choice" else self.output_type
        meta = (self.lm_eval_name, problem.meta["doc_id"], 1)
        return [
            Instance(request_type=request_type, doc=problem.meta["doc"], arguments=(), idx=i, metadata=meta, resps=[res])
            for i, res in enumerate(results)
        ]

    def _apply_filters(self, groups: list[list]) -> tuple[list[dict[str, list]], list[dict[str, str]]]:
        """Every filter pipeline over all samples at once; if one raises, per sample, so one bad sample errors alone."""
        filtered: list[dict[str, list]] = [{} for _ in groups]
        errors: list[dict[str, str]] = [{} for _ in groups]
        for ensemble in self.filters:
            flat = [inst for insts in groups for inst in insts]
            try:
                ensemble.apply(flat)
                for i, insts in enumerate(groups):
                    filtered[i][ensemble.name] = [inst.filtered_resps[ensemble.name] for inst in insts]
                continue
            except Exception:  # noqa: BLE001 - isolate the sample(s) the filter fails on
                pass
            for i, insts in enumerate(groups):
                try:
                    ensemble.apply(insts)
                    filtered[i][ensemble.name] = [inst.filtered_resps[ensemble.name] for inst in insts]
                except Exception as exc:  # noqa: BLE001
                    errors[i][ensemble.name] = f"filter {ensemble.name!r} raised {type(exc).__name__}: {exc}"
        return filtered, errors

    def _score(
        self, problem: Problem, insts: list, filtered: dict[str, list], errors: dict[str, str], note: str | None, completion: str
    ) -> Score:
        """Run process_results per filter; map the primary metric to pass/fail/error, keep every value in details."""
        metrics: dict[str, dict] = {}
        for name, responses in filtered.items():
            try:
                metrics[name] = dict(self.lm.process_results(problem.meta["doc"], responses))
            except Exception as exc:  # noqa: BLE001 - lm-eval scoring failures are grading errors
                errors[name] = f"process_results raised {type(exc).__name__}: {exc}"
        primary = filtered.get(self.filter_name)
        extracted = _extracted(primary, self.output_type, completion)
        details: dict[str, Any] = {"filter": self.filter_name, "metric": self.metric, "metrics": metrics}
        if errors:
            details["errors"] = errors
        if note:
            details["note"] = note
        if self.output_type != "generate_until" and problem.id in self._loglikelihoods:
            details["loglikelihoods"] = self._loglikelihoods[problem.id]
        status = "error"
        if self.filter_name in errors:
            details["reason"] = errors[self.filter_name]
        elif self.metric not in metrics.get(self.filter_name, {}):
            details["reason"] = f"process_results gave no {self.metric!r} (got {', '.join(metrics.get(self.filter_name, {})) or 'nothing'})"
        else:
            status = binary_status(metrics[self.filter_name][self.metric])
            if status == "error":
                details["reason"] = (
                    f"metric {self.metric!r} is {metrics[self.filter_name][self.metric]!r}, not 0/1; pick a 0/1 metric with option `metric`"
                )
        return Score(status, extracted, json.dumps(details, default=_jsonable, ensure_ascii=False))

    @property
    def grader(self) -> tuple[str, str]:
        return f"{PREFIX}:{self.metric}", lm_eval_version()


# --------------------------------------------------------------------------- helpers


def lm_eval_version() -> str:
    """The installed lm-eval version (``unknown`` when it is not installed)."""
    try:
        return metadata.version("lm_eval")
    except metadata.PackageNotFoundError:
        return "unknown"


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def truncate_at_stop(text: str, until: tuple[str, ...] | list[str]) -> str:
    """Cut at the first occurrence of each stop string in turn, as lm-eval's ``postprocess_generated_text``."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def binary_status(value: Any) -> str:
    """1/True -> pass, 0/False -> fail, anything else (NaN, 0.5, a tuple) -> error."""
    if isinstance(value, (list, tuple, dict, str)) or value is None:
        return "error"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "error"
    if math.isnan(number):
        return "error"
    return "pass" if number == 1.0 else "fail" if number == 0.0 else "error"


def _extracted(primary: list | None, output_type: str, completion: str) -> str | None:
    """What the primary filter kept (generation) or the chosen answer (scored tasks), as text."""
    if output_type != "generate_until":
        return completion
    if not primary:
        return None
    value = primary[0]
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, str) else json.dumps(value, default=_jsonable)


def _jsonable(value: Any) -> Any:
    """numpy scalars/arrays and other objects in metric values, as JSON-friendly values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return repr(value)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """lm-eval's chat_template callback, as its HF model renders it."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt
    )


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: trailing context spaces move to the continuation; whole is encoded then split."""
    from opd_harness.rollout import encode

    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    if not context:  # lm-eval conditions an empty context on the end-of-text token
        return [tokenizer.eos_token_id], encode(tokenizer, continuation)
    whole = encode(tokenizer, context + continuation)
    ctx = encode(tokenizer, context)
    return ctx, whole[len(ctx) :]


def _max_length(backend) -> int | None:
    """The model's context length when the backend exposes it (HF config), else None."""
    config = getattr(getattr(backend, "model", None), "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def score_continuations(backend, pairs: list[tuple[str, str]]) -> list[tuple[float, bool, str]]:
    """(sum log-prob of the continuation, is it the greedy continuation, the greedy text) per (context, continuation)."""
    import torch

    tokenizer = backend.tokenizer
    limit = _max_length(backend)
    encoded = []
    for ctx, cont in pairs:
        c, t = encode_pair(tokenizer, ctx, cont)
        if not t:
            raise ValueError(f"continuation {cont!r} encodes to no tokens")
        seq = c + t
        if limit is not None:
            if len(t) >= limit:
                raise ValueError(f"continuation of {len(t)} tokens does not fit the model's {limit}-token context")
            seq = seq[-limit:]  # lm-eval truncates the context on the left
        encoded.append((seq, len(t)))
    pad = getattr(backend, "pad_id", None)
    pad = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    out: list[tuple[float, bool, str]] = []
    for start in range(0, len(encoded), SCORE_BATCH):
        batch = encoded[start : start + SCORE_BATCH]
        width = max(len(s) for s, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (seq, _) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        try:
            scores = backend.score(ids, mask, want=("logprobs", "topk"), top_k=1)
        except NotImplementedError as exc:
            raise ValueError(f"scoring lm-eval continuations needs a backend that scores sequences (hf, vllm, openai): {exc}") from None
        for row, (seq, n_cont) in enumerate(batch):
            span = slice(len(seq) - n_cont, len(seq))
            target = seq[span]
            greedy = scores["topk_ids"][row, span, 0].tolist()
            out.append((float(scores["logprobs"][row, span].sum()), greedy == target, tokenizer.decode(greedy)))
    return out


def make_task_class(name: str) -> type[LmEvalTask]:
    """Any lm-evaluation-harness task, prompted and scored by lm-eval, generated by our backend.

    Name one ``lm_eval:<task>`` with an lm-eval task name, e.g. ``lm_eval:gsm8k`` (``lm-eval ls tasks`` lists them); a task
    from your own YAML files also needs ``--task-arg lm_eval:<task>.include_path=DIR``.

    Builds the harness Task class for lm-eval task ``name`` (registered as ``lm_eval:<name>``)."""
    attrs = {
        "lm_eval_name": name,
        "description": f"lm-evaluation-harness task {name!r} (prompts and scoring by lm-eval, generation by our backend)",
        "__module__": __name__,
        "__qualname__": f"LmEvalTask[{name}]",
    }
    return type(f"LmEvalTask[{name}]", (LmEvalTask,), attrs)

