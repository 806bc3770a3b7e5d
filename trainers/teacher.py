"""The teacher role's engine and its scoring: the in-process HF teacher, or any backend that can score
(``teacher.backend``: a served teacher through ``openai``, a local ``vllm`` engine), and scoring that
never lets a step train on missing teacher log-probs (a failure is retried, then stops the run).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from opd_harness.backends import Backend
from opd_harness.backends.hf import HFBackend, chunk_bounds
from opd_harness.config import TeacherSpec
from opd_harness.errors import TrainingAborted
from opd_harness.models.hub import torch_dtype
from opd_harness.registry import BACKENDS
from opd_harness.teacher_signal import SCORE_FIELD, HiddenDistribution, TeacherDistribution, TopKDistribution
from opd_harness.trajectory import TensorBatch

log = logging.getLogger("opd_harness.trainers.teacher")

RETRY_BACKOFF_S = 2.0
BENCH_S = 30.0  # how long a failed teacher replica gets no new rows (it is tried again if every replica is benched)


class TeacherFailed(TrainingAborted):
    """Teacher scoring of a step failed after every retry (a server down, malformed answers): the run stops, the step is not trained."""


def open_remote_teacher(spec: TeacherSpec, tokenizer_path: str) -> Backend:
    """A teacher on ``spec.backend`` other than hf: loaded (vllm) or connected to (openai) with ``spec.backend_options``;
    the openai teacher encodes with the student's tokenizer (``tokenizer_path``) unless ``backend_options.tokenizer`` says otherwise.
    Several ``teacher.base_url`` replicas become one :class:`TeacherPool`."""
    cls = BACKENDS.get(spec.backend)
    options = dict(spec.backend_options)
    if spec.backend != "openai":
        return cls.load(spec.path, **options)
    options.setdefault("tokenizer", tokenizer_path)
    urls = teacher_urls(spec)
    replicas = [cls.load(served_model(spec, url), base_url=url, **options) for url in urls]
    return replicas[0] if len(replicas) == 1 else TeacherPool(replicas, urls)


def teacher_urls(spec: TeacherSpec) -> list[str]:
    """The served teacher's replicas: ``teacher.base_url`` as a list (one address is a list of one)."""
    return [spec.base_url] if isinstance(spec.base_url, str) else list(spec.base_url or [])


def served_model(spec: TeacherSpec, base_url: str | None = None) -> str:
    """``teacher.path``, or the one model the server lists, once ``GET /v1/models`` shows it is served there;
    an unreachable server or an unserved model stops the run before training (:class:`TeacherFailed`)."""
    import openai

    base_url = base_url or teacher_urls(spec)[0]
    options = spec.backend_options
    client = openai.OpenAI(
        base_url=base_url,
        api_key=options.get("api_key") or os.environ.get("OPENAI_API_KEY") or "EMPTY",
        timeout=float(options.get("timeout_s", 60)),
        max_retries=2,
    )
    try:
        models = [m.id for m in client.models.list()]
    except openai.OpenAIError as exc:
        raise TeacherFailed(
            f"the teacher server at teacher.base_url={base_url} did not answer GET /models ({type(exc).__name__}: {exc})"
        ) from exc
    if spec.path is not None and spec.path not in models:
        raise TeacherFailed(f"teacher.path={spec.path!r} is not served at teacher.base_url={base_url} (it serves {models})")
    if spec.path is None and len(models) != 1:
        raise TeacherFailed(f"teacher.base_url={base_url} serves {models or 'no models'}; set teacher.path to the served model name")
    return spec.path or models[0]


class ReplicasFailed(RuntimeError):
    """Every replica of a :class:`TeacherPool` failed some rows of one call (the step-retry rule then applies)."""


class TeacherPool:
    """Several replicas of one teacher behind one scoring backend: a call's rows are split into contiguous shards, one
    per healthy replica, scored concurrently and put back in order; a replica that fails is benched for ``bench_s``
    and its shard goes to the other replicas. Rows are scored independently, so the result equals one replica's."""

    def __init__(self, replicas: list[Backend], labels: list[str], *, bench_s: float = BENCH_S) -> None:
        if not replicas or len(replicas) != len(labels):
            raise ValueError("a teacher pool needs one label per replica, and at least one replica")
        self.replicas, self.labels, self.bench_s = list(replicas), list(labels), bench_s
        self.benched_until = [0.0] * len(replicas)
        self.failovers = 0  # shards re-sent to another replica
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "replicas":  # not set yet (copy, pickle): no delegation
            raise AttributeError(name)
        return getattr(self.replicas[0], name)  # what a backend has besides score (tokenizer, pad_id, ...) is the first replica's

    def healthy(self, exclude: set[int] = frozenset()) -> list[int]:
        """Replicas not benched and not in ``exclude``; all not excluded when every one is benched (a bench is a hint)."""
        now = time.monotonic()
        left = [i for i in range(len(self.replicas)) if i not in exclude]
        return [i for i in left if self.benched_until[i] <= now] or left

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, want=("logprobs",), top_k: int = 0) -> dict:
        shards = row_shards(len(input_ids), len(self.healthy()))
        with ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="teacher-pool") as pool:
            jobs = [pool.submit(self._score_shard, input_ids[s], attention_mask[s], want, top_k, i) for i, s in enumerate(shards)]
            parts = [job.result() for job in jobs]
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}

    def _score_shard(self, ids: torch.Tensor, mask: torch.Tensor, want, top_k: int, position: int) -> dict:
        """Shard ``position`` on a healthy replica (shard i on the i-th), moving to the next replica while one fails."""
        tried: set[int] = set()
        errors: list[str] = []
        while candidates := self.healthy(tried):
            replica = candidates[position % len(candidates)]
            try:
                return self.replicas[replica].score(ids, mask, want=want, top_k=top_k)
            except Exception as exc:  # noqa: BLE001 - the replica failed this shard: bench it, try another
                tried.add(replica)
                errors.append(f"{self.labels[replica]}: {type(exc).__name__}: {exc}")
                with self._lock:
                    self.benched_until[replica] = time.monotonic() + self.bench_s
                    self.failovers += 1
                log.warning("teacher replica %s failed (%s: %s); its rows go to the others", self.labels[replica], type(exc).__name__, exc)
        raise ReplicasFailed(f"every teacher replica failed ({'; '.join(errors)})")

    def close(self) -> None:
        for replica in self.replicas:
            close = getattr(replica, "close", None)
            if close is not None:
                close()


def row_shards(rows: int, parts: int) -> list[slice]:
    """``rows`` split into at most ``parts`` contiguous, near-equal, non-empty slices (one slice for an empty call)."""
    parts = max(1, min(parts, rows))
    size, extra = divmod(rows, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def teacher_label(spec: TeacherSpec, model_path: str | None) -> str:
    """What the teacher is, for the run's evaluation rows: its folder, or backend, address and served model."""
    if spec.backend == "hf":
        return str(model_path)
    if spec.backend == "openai":
        return "openai:" + ",".join(teacher_urls(spec)) + (f" ({spec.path})" if spec.path else "")
    return f"{spec.backend}:{spec.path}"


def teacher_wants(kind: str) -> tuple[str, ...]:
    """The score fields a teacher signal of ``kind`` is made from: the sampled tokens' log-probs, and its distribution's field."""
    return ("logprobs",) + ((SCORE_FIELD[kind],) if kind in SCORE_FIELD else ())


def output_head(teacher: Backend) -> torch.nn.Module | None:
    """The in-process teacher's output head (what maps its hidden states to logits), None for a teacher without one here."""
    model = getattr(teacher, "model", None)
    return model.get_output_embeddings() if isinstance(model, torch.nn.Module) else None


@torch.no_grad()
def score_teacher(
    teacher: Backend, batch: TensorBatch, *, kind: str = "sampled", top_k: int = 0, dtype: str = "fp32", retries: int = 0,
    step: int | None = None,
) -> None:
    """Fill the teacher's log-probs of the sampled tokens, and its distribution as a signal of ``kind``
    (:mod:`opd_harness.teacher_signal`), into ``batch``, on the CPU; a failed or incomplete scoring is tried ``retries`` more
    times, then raises :class:`TeacherFailed`, so no step trains without them."""
    want, head = teacher_wants(kind), output_head(teacher)
    from_hidden = kind == "full" and head is not None  # the sampled tokens' log-probs from the signal's own hidden states
    extra = {"token_ids": batch.student_topk_ids} if kind == "student_topk" else {}
    asked = tuple(f for f in want if f != "logprobs") if from_hidden else want
    scores = scores_with_retries(teacher, batch, asked, top_k, extra, retries, step)
    batch.teacher_dist = signal_from_scores(kind, scores, dtype, head, batch.student_topk_ids)
    if from_hidden:
        chunk = int(getattr(teacher, "score_chunk", 0) or 0)
        scores["logprobs"] = trained_token_logprobs(batch.teacher_dist, batch.input_ids, batch.loss_mask, chunk)
        check_scores(scores, batch, want)
    batch.teacher_logprobs = scores["logprobs"].float().cpu() * batch.loss_mask


def trained_token_logprobs(dist: HiddenDistribution, input_ids: torch.Tensor, loss_mask: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """(B, T) log-probs of the sampled tokens under a hidden-state teacher signal, at the trained positions only (0
    elsewhere): the teacher's output head and log-softmax run on the completion tokens, not on the prompt and padding,
    where a vocabulary of 151,936 made them most of the scoring (issue 46); ``chunk`` > 0 positions at a time (the
    backend's ``score_chunk``: no (tokens, V) tensor), else all at once."""
    positions = loss_mask.to(dist.hidden.device) > 0
    trained, tokens = dist[positions], input_ids.to(dist.hidden.device)[positions]
    values = []
    for start, stop in chunk_bounds(len(tokens), chunk or max(len(tokens), 1)):
        log_dist = trained[start:stop].log_distribution()
        values.append(log_dist.gather(-1, tokens[start:stop].to(log_dist.device).unsqueeze(-1)).squeeze(-1).cpu())
    out = torch.zeros(tuple(input_ids.shape), dtype=torch.float32)
    out[positions.cpu()] = torch.cat(values) if values else out.new_zeros(0)
    return out


@torch.no_grad()
def rescore_teacher(teacher: Backend, batch: TensorBatch, *, retries: int = 0, step: int | None = None) -> torch.Tensor:
    """T^fresh: the teacher's log-probs of the sampled tokens scored now, on the batch's context as it is at update time
    (``input_ids``), (B, T) on the CPU, zero off trained tokens; the batch is left as it is."""
    scores = scores_with_retries(teacher, batch, ("logprobs",), 0, {}, retries, step)
    return scores["logprobs"].float().cpu() * batch.loss_mask


def scores_with_retries(
    teacher: Backend, batch: TensorBatch, want: tuple[str, ...], top_k: int, extra: dict, retries: int, step: int | None
) -> dict[str, torch.Tensor]:
    """``teacher.score`` of the batch's rows, checked (:func:`check_scores`); tried ``retries`` more times, then
    :class:`TeacherFailed`."""
    for attempt in range(retries + 1):
        try:
            scores = teacher.score(batch.input_ids, batch.attention_mask, want=want, top_k=top_k, **extra)
            check_scores(scores, batch, want)
            break
        except Exception as exc:  # noqa: BLE001 - any failure of the teacher is an infrastructure error of this step
            where = f"step {step}" if step is not None else "a step"
            if attempt == retries:
                raise TeacherFailed(
                    f"teacher scoring of {where} failed after {retries + 1} attempt(s) ({type(exc).__name__}: {exc}); "
                    "the step was not trained. "
                    "Check the teacher (teacher.backend, teacher.base_url), then continue with harness run --resume"
                ) from exc
            log.warning("teacher scoring of %s failed (%s: %s); retry %d/%d", where, type(exc).__name__, exc, attempt + 1, retries)
            time.sleep(RETRY_BACKOFF_S * 2**attempt)
    return scores


def signal_from_scores(
    kind: str, scores: dict[str, torch.Tensor], dtype: str, head: torch.nn.Module | None, token_ids: torch.Tensor | None
) -> TeacherDistribution | None:
    """The compact distribution of ``kind`` from the teacher's scores, on the CPU (hidden states in ``dtype``); None for
    ``sampled``."""
    if kind == "full":
        return HiddenDistribution(scores["hidden"].to("cpu", torch_dtype(dtype)), head)
    if kind == "topk":
        return TopKDistribution(scores["topk_ids"].cpu(), scores["topk_logprobs"].float().cpu())
    if kind == "student_topk":
        return TopKDistribution(token_ids.cpu(), scores["at_ids_logprobs"].float().cpu(), "student_topk")
    return None


def check_scores(scores: dict[str, torch.Tensor], batch: TensorBatch, want: tuple[str, ...]) -> None:
    """Every asked field is there, shaped like the batch, with finite log-probs on the trained tokens."""
    names = {"logprobs": ("logprobs",), "full": ("full",), "topk": ("topk_logprobs", "topk_ids"), "hidden": ("hidden",),
             "at_ids": ("at_ids_logprobs",)}  # fmt: skip
    missing = [name for field in want for name in names[field] if name not in scores]
    if missing:
        raise RuntimeError(f"the teacher returned no {missing}")
    field = names[want[0]][0] if want else "logprobs"
    if tuple(scores[field].shape[:2]) != tuple(batch.input_ids.shape):
        name = "log-probs" if field == "logprobs" else field
        raise RuntimeError(f"the teacher's {name} have shape {tuple(scores[field].shape)}, the batch {tuple(batch.input_ids.shape)}")
    if "logprobs" not in want:
        return
    trained = batch.loss_mask.to(scores["logprobs"].device) > 0
    if torch.isnan(scores["logprobs"][trained]).any():
        raise RuntimeError("the teacher's log-probs are missing (NaN) on trained tokens")


def wrap_hf_teacher(model: torch.nn.Module, tokenizer, batch_size: int, options: dict) -> HFBackend:
    """The in-process teacher around a built or loaded model, frozen."""
    model.requires_grad_(False)
    return HFBackend(model, tokenizer, **{"batch_size": batch_size, **options})
