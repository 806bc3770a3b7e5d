"""``harness run --dry-run`` / ``harness eval --dry-run``: the checks of a planned run before anything runs, one step each:
the tasks' data, the models' configs and tokenizers (never weights; tiny ``arch`` models from their shape), the
teacher–student pair (token ids, EOS/pad, chat template, positions against the longest episode) and the teacher backend's
log-probs (a served teacher is probed with one request). Each step returns (its JSON section, its printed lines, its
failure or None); nothing is put on a device and nothing is written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd_harness.errors import ConfigError

Step = tuple[dict, list[str], "str | None"]
PROMPTS_MEASURED = 5000  # prompts per split whose length is measured for the longest episode


@dataclass
class ModelFiles:
    """What a dry run reads of one model: where it comes from, its config (positions, vocabulary) and its tokenizer."""

    name: str
    source: str
    tokenizer: Any = None
    max_positions: int | None = None
    vocab_size: int | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: source, vocabulary, positions, EOS/pad."""
        tok = self.tokenizer
        special = f", eos {tok.eos_token!r} ({tok.eos_token_id}), pad {tok.pad_token!r} ({tok.pad_token_id})" if tok is not None else ""
        return f"{self.source}; vocab {self.vocab_size}, max positions {self.max_positions}{special}"

    def section(self) -> dict:
        """The JSON section of this model."""
        tok = self.tokenizer
        return {"name": self.name, "source": self.source, "vocab_size": self.vocab_size, "max_positions": self.max_positions,
                "eos": None if tok is None else tok.eos_token, "pad": None if tok is None else tok.pad_token}  # fmt: skip


def read_model_files(name: str, *, flag: str) -> ModelFiles:
    """A model folder or hub id's config.json and tokenizer (weights checked present in a folder, never read)."""
    from opd_harness.models.hub import ModelUnavailable, locate_model
    from opd_harness.models.tiny import load_tokenizer

    try:
        where = locate_model(name, flag=flag)
    except ModelUnavailable as exc:
        raise ConfigError(str(exc)) from None
    if Path(where).is_dir():
        config = json.loads((Path(where) / "config.json").read_text())
    else:  # online hub id: config.json alone
        from opd_harness.models.hub import hub_config

        try:
            config = hub_config(name)
        except Exception as exc:  # noqa: BLE001 - unknown or gated repo: one line
            raise ConfigError(f"{flag} {name}: cannot read its config.json from the hub ({str(exc).strip().splitlines()[0]})") from None
    try:
        tokenizer = load_tokenizer(where)
    except Exception as exc:  # noqa: BLE001 - a folder without tokenizer files
        raise ConfigError(f"{flag} {name}: cannot read its tokenizer ({type(exc).__name__}: {str(exc).strip()[:200]})") from None
    text = config.get("text_config", config)
    source = f"local folder {where}" if Path(name).expanduser().is_dir() else f"hub {name}"
    return ModelFiles(name, source, tokenizer, text.get("max_position_embeddings"), text.get("vocab_size"))


def role_files(spec, role: str) -> ModelFiles | None:
    """The files of ``role`` (``student`` or ``teacher``): a named model's, or a tiny model's shape and character
    tokenizer; None for a teacher on another backend (served: probed by the teacher step)."""
    if getattr(spec, "backend", "hf") != "hf":
        return None
    if spec.path is not None:
        try:
            return read_model_files(spec.path, flag=f"--{role}")
        except ConfigError:
            from opd_harness.memory_plan import published_hub_ids

            known = published_hub_ids().get(spec.path)
            if known is None:
                raise
            from opd_harness.models.shapes import get_shape

            # a published Qwen3 id not cached here (a GPU config planned on a laptop): its shape, no tokenizer to compare
            return ModelFiles(spec.path, f"published shape {known} (not in the hub cache: tokenizer not checked)", None,
                              None, get_shape(known).vocab)  # fmt: skip
    from opd_harness.models.tiny import build_char_tokenizer

    if isinstance(spec.arch, str):
        from opd_harness.models.shapes import build_shape_tokenizer, get_shape

        shape = get_shape(spec.arch)
        return ModelFiles(spec.arch, f"published shape {spec.arch} (random weights)", build_shape_tokenizer(shape.vocab),
                          None, shape.vocab)  # fmt: skip
    tok = build_char_tokenizer()
    return ModelFiles("arch", "tiny model built from arch", tok, spec.arch.max_positions, len(tok))


def data_step(plan) -> Step:
    """Load and validate every task's data (the training split, each evaluated task's test problems)."""
    from opd_harness.plan import DataUnavailable, load_plan_data

    try:
        load_plan_data(plan)
    except DataUnavailable as exc:
        return {"ok": False}, [], str(exc).replace("\n", "; ")
    counts = {f"{plan.task.name} [{plan.task.training_split()}]": len(plan.train_problems or [])}
    counts |= {f"{name} [test]": len(problems) for name, problems in plan.eval_problems.items()}
    return {"ok": True, "problems": counts}, [f"data: {', '.join(f'{k} {v} problems' for k, v in counts.items())}"], None


def models_step(plan, files: dict[str, ModelFiles | None]) -> Step:
    """Each role's model, device and dtype, as the run will place them (read, never loaded)."""
    trainer = plan.config.trainer
    lines, section = [], {}
    for role, found in files.items():
        spec = getattr(plan.config, role)
        place = f"device {trainer.device}, {trainer.precision}" if role == "student" or spec.backend == "hf" else f"backend {spec.backend}"
        what = found.describe() if found is not None else f"served at {spec.base_url} (model {spec.path or 'the server’s only one'})"
        lines.append(f"{role}: {found.name if found else spec.path or 'served'}: {what}; {place}")
        section[role] = {**(found.section() if found else {"served": spec.base_url}), "placement": place}
    if trainer.layout is not None:
        lines.append(placement_line(trainer))
        section["layout"] = trainer.layout.model_dump(mode="json", exclude_none=True)
    lines.append(f"method {plan.method.name} ({trainer.mode}), task {plan.task.name}, eval {', '.join(t.name for t in plan.eval_tasks)}, "
                 f"{trainer.steps} steps, lr {trainer.lr:g}, teacher signal {plan.config.teacher.signal}")  # fmt: skip
    return section, lines, None


def placement_line(trainer) -> str:
    """The Ray layout in one line: each role's replicas × GPUs (and CPUs, node labels), the GPUs in all, the engines and
    the precision (``trainer.device`` is the in-process executor's; Ray actors keep their torch models on the CPU in this
    version, vLLM engines take the GPUs of their replicas)."""
    roles, gpus = [], 0.0
    for role in ("rollout", "teacher", "learner", "eval"):
        spec = getattr(trainer.layout, role, None)
        if spec is None:
            continue
        gpus += spec.replicas * spec.num_gpus
        labels = f", on {'+'.join(spec.resources)}" if spec.resources else ""
        roles.append(f"{role} {spec.replicas} × ({spec.num_gpus:g} GPU, {spec.num_cpus:g} CPU{labels})")
    return (f"layout (executor {trainer.executor}): {'; '.join(roles)}: {gpus:g} GPUs in all; rollout engine "
            f"{trainer.rollout_backend} {trainer.rollout_backend_options or ''}; precision {trainer.precision}, "
            f"activation checkpointing {'on' if trainer.activation_checkpointing else 'off'}")


def pair_step(plan, files: dict[str, ModelFiles | None]) -> Step:
    """The teacher scores the student's tokens: the same id for every token of the student's vocabulary, the same EOS and
    pad, the same chat template when prompts use one, and positions for the longest episode in both models."""
    student, teacher = files["student"], files.get("teacher")
    failure = None
    if student.tokenizer is None or (teacher is not None and teacher.tokenizer is None):
        return {"checked": False}, ["pair: not checked (a tokenizer is not cached here; run --dry-run where the models are)"], None
    if any(f is not None and f.source.startswith("published shape") for f in (student, teacher)):  # random weights: costs only
        return {"checked": False}, ["pair: not checked (a published shape with random weights measures costs, not a pair)"], None
    if teacher is not None:
        failure = (
            vocabulary_difference(student, teacher) or special_difference(student, teacher) or template_difference(plan, student, teacher)
        )
    longest, where = longest_episode(plan, student.tokenizer)
    for found in (f for f in (student, teacher) if f is not None and f.max_positions is not None):
        if failure is None and longest > found.max_positions:
            role = "student" if found is student else "teacher"
            failure = (f"{role} {found.name}: max_positions {found.max_positions} < the longest episode, {longest} tokens ({where}); "
                       "lower max_new_tokens or choose a model with a longer context")  # fmt: skip
    lines = [f"pair: {'same token ids, EOS and pad' if teacher is not None else 'served teacher: tokens checked by its probe'}; "
             f"longest episode {longest} tokens ({where})"]  # fmt: skip
    return {"longest_episode": longest, "ok": failure is None}, lines if failure is None else [], failure


def vocabulary_difference(student: ModelFiles, teacher: ModelFiles) -> str | None:
    """The first token of the student's vocabulary (by id) whose id differs in the teacher's, or None."""
    theirs = teacher.tokenizer.get_vocab()
    for token, index in sorted(student.tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if theirs.get(token) != index:
            found = "absent" if token not in theirs else f"id {theirs[token]}"
            return (f"the teacher's tokenizer differs from the student's: token {token!r} is id {index} in the student's and "
                    f"{found} in the teacher's; the teacher must score the student's token ids (use one tokenizer family)")  # fmt: skip
    if teacher.vocab_size is not None and student.vocab_size is not None and teacher.vocab_size < len(student.tokenizer):
        return f"the teacher's vocabulary ({teacher.vocab_size} ids) is smaller than the student's tokenizer ({len(student.tokenizer)})"
    return None


def special_difference(student: ModelFiles, teacher: ModelFiles) -> str | None:
    """EOS or pad tokens that differ between the two tokenizers, or None."""
    for name in ("eos", "pad"):
        mine, theirs = getattr(student.tokenizer, f"{name}_token"), getattr(teacher.tokenizer, f"{name}_token")
        if mine != theirs:
            return (f"the teacher's {name.upper()} token {theirs!r} differs from the student's {mine!r}: the teacher would score "
                    f"the student's {'stops' if name == 'eos' else 'padding'} as ordinary text (pair models of one family)")  # fmt: skip
    return None


def template_difference(plan, student: ModelFiles, teacher: ModelFiles) -> str | None:
    """Chat templates that differ, when a task of the run formats prompts with one, or None."""
    tasks = [plan.task, *plan.eval_tasks]
    if not any(getattr(t.options, "use_chat_template", False) for t in tasks):
        return None
    mine, theirs = getattr(student.tokenizer, "chat_template", None), getattr(teacher.tokenizer, "chat_template", None)
    if mine != theirs:
        which = "has none" if theirs is None else "differs" if mine is not None else "has one and the student's none"
        return (
            f"the teacher's chat template {which} (the student's prompts are rendered with the student's template, so the "
            "teacher scores a format it was not trained on); pair models of one family or set use_chat_template=false"
        )
    return None


def longest_episode(plan, tokenizer) -> tuple[int, str]:
    """The longest prompt (the first PROMPTS_MEASURED of each split, as the student's template renders it) plus the tokens an
    episode may generate (trainer.max_new_tokens or the task's; a multi-turn task's max_context_tokens when it has one)."""
    best, where = 0, "no problems"
    splits = [(plan.task, plan.train_problems or [], plan.config.trainer.max_new_tokens)]
    splits += [(t, plan.eval_problems.get(t.name, []), None) for t in plan.eval_tasks]
    for task, problems, max_new in splits:
        budget = getattr(task.options, "max_context_tokens", None)
        new = max_new or task.options.max_new_tokens
        for problem in problems[:PROMPTS_MEASURED]:
            length = len(tokenizer(task.format_prompt(problem, tokenizer), add_special_tokens=False)["input_ids"]) + new
            length = max(length, budget or 0)
            if length > best:
                best, where = length, f"{task.name} {problem.id}: prompt + {new} new tokens"
    return best, where


def teacher_step(plan, files: dict[str, ModelFiles | None]) -> Step:
    """The teacher backend returns the log-probs the method reads: an in-process teacher does (planned); a served one is
    asked once, for a short row of the student's tokens."""
    teacher, signal = plan.config.teacher, plan.config.teacher.signal
    needs = plan.method.accepted_signals(plan.hparams)
    if not needs:
        return {"reads": []}, [f"teacher: method {plan.method.name} reads no teacher signal"], None
    if teacher.backend != "openai":
        return {"reads": signal}, [f"teacher: {teacher.backend} backend scores in process ({signal})"], None
    from opd_harness.registry import BACKENDS
    from opd_harness.teacher_signal import SCORE_FIELD

    want = ("logprobs",) + (("topk",) if SCORE_FIELD.get(signal) == "topk" else ())
    try:
        import torch

        url = teacher.base_url if isinstance(teacher.base_url, str) else teacher.base_url[0]
        options = {"timeout_s": 10, "tokenizer": plan.config.student.path, **teacher.backend_options}
        options |= {"max_retries": 0, "connect_retries": 0}  # one request
        backend = BACKENDS.get("openai").load(teacher.path or served_model(url, options), base_url=url, **options)
        ids = files["student"].tokenizer("1+1=2", add_special_tokens=False)["input_ids"]
        row = torch.tensor([ids[:8] or [0, 0]])
        scores = backend.score(row, torch.ones_like(row), want=want, top_k=teacher.top_k if "topk" in want else 0)
        if not torch.isfinite(scores["logprobs"][0, 1:]).all() or not scores["logprobs"][0, 1:].ne(0).any():
            raise ValueError("the log-probs it returned are empty or not finite")
    except Exception as exc:  # noqa: BLE001 - an unreachable server, one without prompt log-probs: one line either way
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        failure = (f"teacher.base_url={teacher.base_url}: the served teacher did not return the log-probs method "
                   f"{plan.method.name!r} needs ({signal}) for a probe request: {first}")  # fmt: skip
        return {"reads": signal, "ok": False}, [], failure
    return {"reads": signal, "ok": True}, [f"teacher: served at {teacher.base_url}, probe returned {signal} log-probs"], None


def served_model(base_url: str, options: dict) -> str:
    """The one model a server lists (``GET /models``), for a served teacher without ``teacher.path``."""
    import os

    import openai

    client = openai.OpenAI(base_url=base_url, api_key=options.get("api_key") or os.environ.get("OPENAI_API_KEY") or "EMPTY",
                           timeout=float(options.get("timeout_s", 10)), max_retries=0)  # fmt: skip
    models = [m.id for m in client.models.list()]
    if len(models) != 1:
        raise ValueError(f"the server lists {models}; set teacher.path to the served model's name")
    return models[0]
