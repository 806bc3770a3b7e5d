"""Run configuration: pydantic models, YAML presets, ``--config`` files and dotted ``--set`` overrides.

Precedence: built-in defaults < preset < config file < ``--set`` < explicit CLI flags. Every
error names the offending key and what is allowed.
"""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from opd_harness.errors import ConfigError
from opd_harness.models.shapes import SHAPES
from opd_harness.models.tiny import TinyArch

ShapeName = Literal[tuple(SHAPES)]  # type: ignore[valid-type]  # a published Qwen3 shape, built with random weights


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SFTTarget(Strict):
    """The held-out quality a tiny model's supervised warm-up must reach: rounds of ``sft_steps`` one-cycle SFT steps, each
    followed by Avg@k on ``heldout`` training problems kept out of the SFT data, until ``avg_at_k`` or ``max_steps``."""

    avg_at_k: float = Field(ge=0.0, le=1.0, description="held-out Avg@k the warm-up trains until (checked after every round of sft_steps)")
    max_steps: int = Field(ge=1, description="cap on the SFT steps of all rounds together (a multiple of sft_steps)")
    heldout: int = Field(50, ge=1, description="training problems held out of the SFT data and evaluated after each round")
    k: int = Field(4, ge=1, description="episodes per held-out problem (Avg@k)")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the held-out episodes")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of the held-out episodes (set it as eval.top_p is)")
    on_miss: Literal["fail", "warn"] = Field(
        "fail",
        description=(
            "when max_steps ends the warm-up below avg_at_k: fail (the run stops, exit 2, naming this key) or warn (the run goes on "
            "with the model, recorded and printed as below its target)"
        ),
    )


class ModelSpec(Strict):
    """Either a pretrained model (``path``: local dir or hub id) or a tiny model built from ``arch``."""

    path: str | None = Field(None, description="local directory or Hugging Face hub id")
    arch: TinyArch | ShapeName | None = Field(
        None,
        description=(
            "build a Qwen3 model here: a tiny shape (hidden, layers, ...) or a published one by name "
            f"({', '.join(SHAPES)}: random weights, for cost measurements only, never accuracy)"
        ),
    )
    sft_steps: int = Field(0, ge=0, description="supervised warm-up steps on the training task's reference solutions")
    sft_lr: float = Field(3e-3, gt=0)
    sft_batch_size: int = Field(64, ge=1)
    seed: int = 0
    sft_target: SFTTarget | None = Field(
        None,
        description=(
            "warm up until this held-out quality (rounds of sft_steps, checked on training problems kept out of the SFT data) "
            "instead of a fixed sft_steps; what it reached is recorded with the run (opd_harness.trainers.warmup)"
        ),
    )

    @field_validator("arch", mode="before")
    @classmethod
    def _known_shape(cls, value: Any) -> Any:
        """A shape given by name must be one of :data:`SHAPES` (one line naming them, not pydantic's union error)."""
        if isinstance(value, str) and value not in SHAPES:
            raise ValueError(f"unknown model shape {value!r}; give a tiny shape (hidden, layers, ...) or one of {', '.join(SHAPES)}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        check_one_source(self)
        return self

    @model_validator(mode="after")
    def _target_needs_warmup(self) -> "ModelSpec":
        """sft_target: a tiny model warmed up here, in whole rounds of sft_steps."""
        target = self.sft_target
        if target is None:
            return self
        if not self.sft_steps or not isinstance(self.arch, TinyArch):
            raise ValueError("sft_target needs a tiny model warmed up here: a tiny arch and sft_steps > 0 (the length of one round)")
        if target.max_steps % self.sft_steps:
            raise ValueError(f"sft_target.max_steps ({target.max_steps}) must be a multiple of sft_steps ({self.sft_steps}): whole rounds")
        return self


def check_one_source(spec: ModelSpec) -> None:
    """A model built or loaded here comes from exactly one of ``path`` and ``arch``."""
    if (spec.path is None) == (spec.arch is None):
        raise ValueError("give exactly one of 'path' (a pretrained model) or 'arch' (a tiny model to build)")


class TeacherSpec(ModelSpec):
    """The teacher: a model built or loaded here (``backend: hf``, the default) or any backend that can score,
    e.g. a served teacher (``backend: openai``, ``base_url``) or a vLLM engine on this machine (``backend: vllm``)."""

    backend: str = Field(
        "hf", description="scoring backend of the teacher role: hf (in-process), vllm, or openai (a served teacher at base_url)"
    )
    base_url: str | list[str] | None = Field(
        None,
        description=(
            "backend openai: the teacher server's address, e.g. http://HOST:PORT/v1, or a list of replicas' addresses "
            "(one load-balancing client: each batch is split over them, a failed replica's rows go to the others)"
        ),
    )
    backend_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "options for the teacher backend's load, e.g. openai: timeout_s, max_retries, connect_retries, "
            "retry_backoff_s, concurrency, api_key, tokenizer"
        ),
    )
    signal: Literal["auto", "sampled", "topk", "student_topk", "full"] = Field(
        "auto",
        description=(
            "what the teacher gives a method that reads its distribution (opd_harness.teacher_signal): full (the exact distribution, "
            "carried as last hidden states + the output head), topk (its top-k log-probs + a tail bucket), student_topk (its "
            "log-probs on the student's top-k tokens + tail), sampled (the sampled token's log-prob only); auto: the first kind "
            "the method accepts that the backend gives (hf: full; openai, vllm: topk)"
        ),
    )
    top_k: int = Field(20, ge=1, description="k of the topk and student_topk signals")
    signal_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of the full signal's hidden states in a batch (log-probs stay float32)"
    )
    step_retries: int = Field(
        1,
        ge=0,
        description=(
            "re-score a step's batch this many times after a teacher failure (after the backend's own retries) before the run stops"
        ),
    )

    @model_validator(mode="after")
    def _one_source(self) -> "TeacherSpec":
        """hf: exactly one of path/arch. Another backend builds nothing here: no arch or warm-up; openai's path is the
        served model name (optional: the server's only model), vllm's the model folder."""
        backend = registered("BACKENDS", self.backend, prefix="backend: ")
        if not getattr(backend, "score_fields", ()):
            raise ValueError(f"backend: {self.backend!r} cannot score sequences, so it cannot be a teacher; choose hf, vllm or openai")
        unknown = sorted(set(self.backend_options) - set(load_options(backend)))
        if unknown:
            raise ValueError(
                f"backend_options: {unknown} are not options of the {self.backend} backend (it takes {', '.join(load_options(backend))})"
            )
        if self.backend == "hf":
            if self.base_url is not None:
                raise ValueError("base_url is used only with teacher.backend=openai")
            check_one_source(self)
            return self
        if self.arch is not None or self.sft_steps:
            raise ValueError(
                f"arch and sft_steps describe a tiny teacher built here; a teacher on backend {self.backend!r} is not built here: "
                "set teacher.arch=null and teacher.sft_steps=0"
            )
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend=openai needs the teacher server's address: set teacher.base_url=http://HOST:PORT/v1")
        if isinstance(self.base_url, list) and len(set(self.base_url)) != len(self.base_url):
            raise ValueError(f"base_url: the replicas' addresses {self.base_url} name one server twice (each replica once)")
        if self.backend != "openai" and self.base_url is not None:
            raise ValueError("base_url is used only with teacher.backend=openai")
        if self.backend != "openai" and self.path is None:
            raise ValueError(f"backend={self.backend!r} loads the teacher's model folder: set teacher.path")
        return self


def registered(registry: str, name: str, prefix: str = "") -> Any:
    """What ``name`` is registered as in ``opd_harness.registry.<registry>``; a miss is a ``ValueError`` (pydantic's validation
    error, one line naming the key) carrying the registry's message (the known names, a close match), after ``prefix``."""
    from opd_harness import registry as registries

    try:
        return getattr(registries, registry).get(name)
    except registries.RegistryError as exc:
        raise ValueError(f"{prefix}{exc}") from None


def load_options(backend: type) -> list[str]:
    """The keyword options a backend's ``load`` takes (its constructor's when ``load`` forwards ``**options``)."""
    import inspect

    def keywords(fn, skip: int) -> tuple[list[str], bool]:
        params = list(inspect.signature(fn).parameters.values())[skip:]
        named = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return named, any(p.kind is p.VAR_KEYWORD for p in params)

    named, forwards = keywords(backend.load, 1)  # bound classmethod: (model, ...)
    if forwards:
        named += keywords(backend.__init__, 3)[0]  # (self, model, tokenizer, ...)
    return sorted(set(named) - {"base_url"})


LAYOUT_ROLES = ("rollout", "teacher", "learner", "eval")


class RoleLayout(Strict):
    """Where one role's replicas run on a Ray cluster: the resources of each replica and how they spread over nodes."""

    replicas: int = Field(
        1, ge=1, description="actors of this role (rollout: workers on one queue; teacher: scorers behind one chooser; learner: DP ranks)"
    )
    num_cpus: float = Field(1.0, ge=0, description="logical CPUs per replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per replica, e.g. a node label {node_a: 1} given to ray start --resources"
    )
    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack",
        description="the role's placement group strategy: pack its replicas on few nodes or spread them over many (best "
        "effort), or strict_pack (all on one node) / strict_spread (each on its own node), reserved so or refused",
    )

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        """CPUs and GPUs have their own keys; a custom amount is positive."""
        for name, amount in resources.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name!r} is set with num_{name.lower()}s, not resources")
            if amount <= 0:
                raise ValueError(f"{name}: an amount must be > 0 (got {amount})")
        return resources

    @model_validator(mode="after")
    def _asks_something(self) -> "RoleLayout":
        if not (self.num_cpus or self.num_gpus or self.resources):
            raise ValueError("a replica must ask for some resource: num_cpus, num_gpus or resources")
        return self


def fsdp2_unsupported() -> str | None:
    """Why this torch cannot shard a learner with FSDP2 (``torch.distributed.fsdp.fully_shard``), or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - torch >= 2.6
    except ImportError:
        import torch

        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2 needs torch >= 2.6)"
    return None


PLANNING = "planning"  # validation context key: the config is only planned here (--print-config, --dry-run), run elsewhere


def planning_only(info: ValidationInfo) -> bool:
    """Whether this validation only plans the run (``build_config(planning=True)``): what this host has is not checked."""
    return bool((info.context or {}).get(PLANNING))


def device_unavailable(device: str, *, here: bool = True, key: str = "trainer.device") -> str | None:
    """Why ``key`` (``trainer.device``, or a backend's ``device``) cannot be used (an unknown name; with ``here``, no CUDA
    or an index past this host's device count), else None."""
    if device in ("cpu", "auto"):
        return None
    kind, _, index = str(device).partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        return f"{key}={device!r}: choose cpu, cuda, cuda:N or auto"
    if not here:
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{key}={device!r}: torch sees no CUDA device here (torch {torch.__version__}); use cpu or auto"
    if index and int(index) >= torch.cuda.device_count():
        return f"{key}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


class LearnerLayout(RoleLayout):
    """``trainer.layout.learner``: the data-parallel learner ranks and how their model is split over them."""

    sharding: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="with replicas >= 2: ddp (a full copy of weights, gradients and AdamW state per rank) or fsdp2 "
        "(torch's fully_shard: parameters, gradients and optimizer state sharded over the ranks)",
    )

    @field_validator("sharding")
    @classmethod
    def _torch_supports(cls, sharding: str) -> str:
        """FSDP2 only where this torch has it (checked here, at config time; the learner's device is checked when it joins)."""
        why = fsdp2_unsupported() if sharding == "fsdp2" else None
        if why:
            raise ValueError(f"fsdp2 is not supported here: {why}; use ddp")
        return sharding


class EvalRoleLayout(RoleLayout):
    """``trainer.layout.eval``: the evaluation workers of a run's checkpoint evaluations, and how many sandboxes they may
    hold open at once on one node."""

    max_sandboxes: int | None = Field(
        None, ge=1, description="most evaluation workers of the run holding a task sandbox open at once on one node (default: no bound)"
    )


class Layout(Strict):
    """``trainer.layout``: the Ray placement of every role (``--executor ray``); roles left out take the defaults."""

    rollout: RoleLayout = Field(default_factory=RoleLayout)
    teacher: RoleLayout = Field(default_factory=RoleLayout)
    learner: LearnerLayout = Field(default_factory=LearnerLayout)
    eval: EvalRoleLayout | None = Field(
        None,
        description="evaluation workers of the run's checkpoint evaluations (their shards, in this role's placement group); "
        "unset: the driver evaluates",
    )


class TrackingConfig(Strict):
    """Names the trackers give the run (``trainer.tracking.*``; README *Trackers*)."""

    project: str = Field("opd-harness", description="W&B project and MLflow experiment")
    name: str | None = Field(None, description="W&B and MLflow run name (default: the run id)")
    tags: list[str] = Field(default_factory=list, description="W&B tags; MLflow tags (TAG=true)")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI (default: a file store under the run folder, runs/<id>/mlruns)")

    @field_validator("mlflow_uri")
    @classmethod
    def _servable_uri(cls, uri: str | None) -> str | None:
        """A URI scheme an MLflow store serves (checked only when MLflow is installed; trainer.loggers needs it to use it)."""
        from opd_harness.tracking import check_mlflow_uri

        if uri is not None and importlib.util.find_spec("mlflow") is not None:
            check_mlflow_uri(uri)
        return uri


class TrainerConfig(Strict):
    loggers: list[str] = Field(
        default_factory=lambda: ["jsonl"],
        description="trackers of step metrics and evaluations: jsonl (always on), tensorboard, wandb, mlflow "
        "(pip install 'opd-harness[tracking]')",
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    mode: Literal["sync", "async"] = Field("sync", description="pipeline: sync, or async (rollout worker + learner overlap)")
    executor: str = Field(
        "inprocess",
        description=(
            "where the roles run: inprocess (threads in this process) or ray (rollout, teacher and learner actors); "
            "see opd_harness.registry.EXECUTORS"
        ),
    )
    rollout_backend: str = Field(
        "hf",
        description="inference backend of the rollout role (e.g. vllm on a GPU); it receives the learner's weights through load_weights",
    )
    rollout_backend_options: dict[str, Any] = Field(
        default_factory=dict, description="options passed to the rollout backend's load (e.g. gpu_memory_utilization)"
    )
    ray_address: str | None = Field(
        None, description="executor ray: address of an existing cluster (host:6379 or ray://host:10001); default: start a local Ray"
    )
    layout: Layout | None = Field(
        None, description="executor ray: resources and placement of each role (trainer.layout.<role>); default: no resource requests"
    )
    behaviour_logprobs: Literal["recompute", "engine"] = Field(
        "recompute",
        description="π_old of PPO-style ratios: recompute (the trainer's model under the behaviour weights; ρ = 1 at lag 0) or engine "
        "(the rollout engine's own scores, e.g. vLLM's, off the trainer's by their numerics)",
    )
    max_lag: int = Field(1, ge=0, description="async: no sample is trained on with policy lag above this")
    fixed_lag: int | None = Field(
        None, ge=0, description="async lag study: every batch is generated by the policy exactly this many versions old"
    )
    sync_every: int = Field(
        1, ge=1, description="async: rollout weights are refreshed every N learner steps (or sooner if max_lag requires)"
    )
    weight_sync: str = Field(
        "object_store",
        description="how each learner version a rollout worker will load reaches it, in the rollout engine's dtype: object_store "
        "(one copy by reference) or collective (executor ray: bucketed broadcast from learner rank 0 over gloo/NCCL); see "
        "opd_harness.registry.WEIGHT_SYNCS",
    )
    rollout_unit: Literal["batch", "group"] = Field(
        "batch",
        description="what a rollout worker takes from the queue and streams back: a whole batch, or one prompt group (a prompt's "
        "samples_per_prompt episodes); with group a worker keeps a batch's worth of groups in flight, so a slow episode holds only "
        "its group",
    )
    steps: int = Field(400, ge=1, description="optimizer steps")
    prompts_per_step: int = Field(64, ge=1)
    samples_per_prompt: int = Field(
        1, ge=1, description="default: the method's group size for group-baseline methods (grpo 8, sod 16, saf_opd 8), else 1"
    )
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up")
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm; 0 disables")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="the learner's forward/backward (--dtype): fp32, or bf16 autocast (weights, gradients and AdamW state stay "
        "float32); auto: bf16 on a CUDA device that supports it, else fp32 (resolved here, stored resolved); fp16 is refused "
        "(float16 training needs loss scaling, which the learner does not do)",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward pass (less memory, about 1/3 more compute)"
    )
    forward_tokens: int = Field(
        2048,
        ge=0,
        description="the learner's forward and the in-process teacher's scoring run on length-sorted row groups of at most this many "
        "padded tokens (a longer row alone): the same results with less padding computed, and with bucket_backward the learner's "
        "activation memory is one group's, not the step's (0: the whole batch in one forward)",
    )
    bucket_backward: bool = Field(
        True,
        description="a step of several forward_tokens groups runs its backward one group at a time (gradient caching: a forward "
        "without a graph, the objective on the whole batch, then each group's forward and backward again): the gradients of "
        "one graph, activation memory of one group, about one more forward of compute; false: one graph over the step",
    )
    graph_memory_gib: float = Field(
        8.0,
        ge=0,
        description="bucket_backward applies only to steps whose one graph would keep more than this many GiB of activations "
        "(estimated per learner rank with the memory plan's formula from the student's shape and the step's bucketed tokens); "
        "smaller steps keep one graph over their forward_tokens groups, as TRL does, and skip the extra forward (0: always per group)",
    )
    vocab_chunk: int = Field(
        0,
        ge=0,
        description="run the student's output head this many positions at a time under activation checkpointing (the sampled "
        "tokens' log-probs and entropy, and a full-vocabulary method's per-position terms), and the teacher's scoring likewise, "
        "so no (B, T, V) logits or log-probs are kept (0: the whole tensor)",
    )
    collective_timeout_s: float = Field(
        300.0,
        gt=0,
        description="data-parallel learner ranks (trainer.layout.learner.replicas >= 2): a collective that does not complete within "
        "this many seconds (a rank that hangs or makes different calls) fails the run naming the rank and the step; its last "
        "checkpoint resumes",
    )
    actor_timeout_s: float = Field(
        900.0,
        gt=0,
        description="executor ray: the longest one call to a rollout, teacher or learner actor or an evaluation worker may take "
        "(a unit's generation, a batch's scoring, a step, an evaluation shard); past it the actor counts as hung: a rollout or "
        "teacher actor or an evaluation worker is killed, restarted by Ray and its work re-queued, a learner rank fails the run",
    )
    actor_restart_timeout_s: float = Field(
        300.0,
        gt=0,
        description="executor ray: how long an actor may take to start (every role, at the run's start) and a dead or killed "
        "rollout/teacher actor or evaluation worker to come back (imports, model, placement) before the run fails naming the "
        "role and its node",
    )
    device: str = Field(
        "cpu",
        description="where the executor inprocess puts the student (learner), the hf/hf_static rollout engine and the in-process "
        "teacher: cpu, cuda, cuda:N, or auto (cuda when torch sees one, else cpu). With --executor ray every actor takes the "
        "GPUs of its trainer.layout.<role>.num_gpus and the driver keeps its models on the CPU; cuda there asks that every "
        "placed role has GPUs",
    )
    checkpoint_every: int = Field(100, ge=1)
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1)
    enable_thinking: bool | None = Field(
        None, description="Qwen3's thinking switch, passed to the chat template of the pretrained student (its prompts, rollouts "
        "and evaluations) and teacher (its reference evaluation); None: the template's own default",
    )
    max_new_tokens: int | None = Field(None, ge=1, description="default: the task's max_new_tokens")
    generate_batch_size: int = Field(256, ge=1)
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss or gradient norm: stop the run (status failed), or skip that optimizer step and go on"
    )
    max_grade_error_rate: float = Field(
        0.02, ge=0, le=1, description="stop the run when a step's share of grading errors exceeds this (as harness eval --max-error-rate)"
    )

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, loggers: list[str]) -> list[str]:
        """Known trackers whose packages are installed, jsonl first; refused here, before anything is written."""
        from opd_harness.tracking import check_loggers

        return check_loggers(loggers)

    @field_validator("executor")
    @classmethod
    def _known_executor(cls, executor: str) -> str:
        """A registered executor; fail at validation, not after the models are built, when Ray is missing."""
        registered("EXECUTORS", executor)
        if executor == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("--executor ray needs Ray, which is not installed; install it with: pip install 'opd-harness[ray]'")
        return executor

    @field_validator("weight_sync")
    @classmethod
    def _known_weight_sync(cls, name: str) -> str:
        """A registered weight transport (the ``opd_harness.weight_syncs`` plug-ins)."""
        registered("WEIGHT_SYNCS", name)
        return name

    @field_validator("rollout_backend")
    @classmethod
    def _rollout_engine(cls, name: str) -> str:
        """A registered backend that can take the learner's weights (``load_weights``) and has a ``load``."""
        backend = registered("BACKENDS", name)
        if not (callable(getattr(backend, "load_weights", None)) and callable(getattr(backend, "load", None))):
            raise ValueError(
                f"backend {name!r} cannot be a rollout engine: it has no load_weights(state, version) to receive the learner's weights"
            )
        return name

    @field_validator("device")
    @classmethod
    def _device_here(cls, device: str, info: ValidationInfo) -> str:
        """cpu, auto, or a CUDA device this machine has (torch is imported only to check a CUDA one); when only planning
        (``--print-config``, ``--dry-run`` of a GPU run on another host), any well-formed device name."""
        on_ray = (info.data or {}).get("executor") == "ray"  # the actors' devices are Ray's, not this host's
        why = device_unavailable(device, here=not planning_only(info) and not on_ray)
        if why:
            raise ValueError(why)
        return device

    @model_validator(mode="after")
    def _resolve_precision(self, info: ValidationInfo) -> "TrainerConfig":
        """``auto``: bf16 where the learner runs on a CUDA device that supports it (planned on another host: assumed), else
        fp32; ``fp16`` refused in one line."""
        if self.precision == "fp16":
            raise ValueError("trainer.precision=fp16 (--dtype fp16): float16 training needs loss scaling, which the learner does "
                             "not do; use bf16 (or fp32)")  # fmt: skip
        if self.precision == "auto":
            from opd_harness.models.hub import auto_precision

            self.precision = auto_precision(self.device, planning=planning_only(info))
        return self

    @model_validator(mode="after")
    def _device_and_chunks_fit_the_executor(self) -> "TrainerConfig":
        if self.executor == "ray" and self.device not in ("cpu", "auto"):
            if self.device != "cuda":
                raise ValueError(f"trainer.device={self.device!r}: with --executor ray Ray picks each actor's GPUs "
                                 "(trainer.layout.<role>.num_gpus); use cuda, auto or cpu")  # fmt: skip
            without = [role for role in LAYOUT_ROLES if self.layout is None or
                       (getattr(self.layout, role) is not None and getattr(self.layout, role).num_gpus == 0)]  # fmt: skip
            if without:
                raise ValueError(f"trainer.device=cuda with --executor ray: each actor runs on the GPUs its role asks for, and "
                                 f"trainer.layout.{without[0]}.num_gpus is 0 (give every role GPUs, or use auto or cpu)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _address_needs_ray(self) -> "TrainerConfig":
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError(f"trainer.ray_address={self.ray_address!r} is used only with --executor ray (trainer.executor=ray)")
        if self.layout is not None and self.executor != "ray":
            raise ValueError("trainer.layout places the roles on a Ray cluster: it is used only with --executor ray (trainer.executor=ray)")
        ranks, samples = (self.layout.learner.replicas if self.layout else 1), self.prompts_per_step * self.samples_per_prompt
        if ranks > samples:
            raise ValueError(f"trainer.layout.learner.replicas={ranks}: more learner ranks than samples in a batch "
                             f"(prompts_per_step × samples_per_prompt = {samples}); every rank needs at least one")  # fmt: skip
        return self


class EvalConfig(Strict):
    tasks: list[str] = Field(
        default_factory=list,
        description="tasks each checkpoint is evaluated on; the training task is among them (first when the list omits it) unless "
        "it has no test split (a training-only prompt set)",
    )
    k: int | None = Field(None, ge=1, description="samples per problem (default: the task's k)")
    limit: int | None = Field(None, ge=1, description="evaluate the first N problems of each task")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    before_training: bool = Field(True, description="evaluate the initial student as checkpoint 0")
    teacher: bool = Field(True, description="evaluate the teacher once, as a reference row")
    n_resamples: int = Field(10_000, ge=100, description="bootstrap resamples for confidence intervals")
    shard_size: int | None = Field(
        None, ge=1, description="problems per evaluation shard, all k samples of a problem in one (default: as many as fill 64 samples)"
    )
    seed: int = 0


class RunConfig(Strict):
    """The whole configuration of one run (`harness run --print-config` prints it); `build_config` makes one from the layers."""

    method: str = "opd"
    task: str = "arith"
    seed: int = 0
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: all cores in sync mode, 1 per role in async mode or with executor ray)"
    )
    student: ModelSpec = Field(default_factory=lambda: ModelSpec(arch=TinyArch(hidden=128, layers=2), sft_steps=300, seed=1))
    teacher: TeacherSpec = Field(default_factory=lambda: TeacherSpec(arch=TinyArch(hidden=192, layers=3, ffn=384), sft_steps=800))
    method_args: dict[str, dict[str, Any]] = Field(default_factory=dict, description="hyper-parameters by method name")
    task_args: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-task options, by task name")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="before")
    @classmethod
    def _command_defaults(cls, data: Any) -> Any:
        """What the command means when nothing says otherwise: the method's own pipeline (``MethodSpec.default_mode``,
        e.g. async for f-OPD) and evaluation on the training task. A stored config names both, so a resumed run keeps its own."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        task = data.get("task", cls.model_fields["task"].default)
        trainer = data.get("trainer") if isinstance(data.get("trainer"), dict) else None
        if (trainer is None and "trainer" not in data) or (trainer is not None and "mode" not in trainer):
            mode = default_mode(data.get("method", cls.model_fields["method"].default))
            if mode is not None:
                data["trainer"] = {**(trainer or {}), "mode": mode}
        evaluation = data.get("eval") if isinstance(data.get("eval"), dict) else None
        no_tasks = (evaluation is None and "eval" not in data) or (evaluation is not None and not evaluation.get("tasks"))
        if isinstance(task, str) and no_tasks:
            data["eval"] = {**(evaluation or {}), "tasks": [task]}
        return data


def default_mode(method: Any) -> str | None:
    """The registered method's default ``trainer.mode``, or None for an unknown one (planning names it)."""
    from opd_harness.registry import METHODS, RegistryError

    try:
        return METHODS.get(method).default_mode if isinstance(method, str) else None
    except RegistryError:
        return None


PRESETS = ("smoke", "cpu-demo", "tool-demo")
PRESET_NOTES = {  # what `harness run --preset NAME` says before it starts ({models}: where warmed-up models are cached)
    "cpu-demo": "takes about 6 minutes on 2 CPU cores, the teacher's and student's SFT warm-ups included; both are cached "
    "under {models}, so the next run loads them and skips the warm-ups",
}


def load_preset(name: str) -> dict:
    """The YAML of a built-in preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    text = resources.files("opd_harness.presets").joinpath(f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def load_yaml_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict, update: dict) -> dict:
    """Recursive dict merge; ``update`` wins."""
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_override(item: str) -> dict:
    """``a.b.c=value`` → nested dict; the value is parsed as YAML (numbers, lists, booleans)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    for part in reversed(key.split(".")):
        value = {part: value}
    return value  # type: ignore[return-value]


def format_validation_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per error: the dotted key, the problem, and for unknown keys the allowed ones."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, err["loc"][:-1])
            lines.append(f"unknown key {key!r}; allowed here: {', '.join(allowed)}")
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _allowed_keys(model: type[BaseModel], path: tuple) -> list[str]:
    current: Any = model
    for part in path:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _model_of(field.annotation)
    return sorted(getattr(current, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def retarget_preset(preset: dict, task: str | None, task_args: dict | None = None) -> dict:
    """A preset run on another task: its evaluation follows the new task, its options for the old one are dropped, and
    its tiny models are fitted to the new task (``--preset smoke --task swebench`` evaluates and trains on swebench)."""
    old = preset.get("task")
    if not task or not old or task == old:
        return preset
    out = {**preset, "task_args": {k: v for k, v in preset.get("task_args", {}).items() if k != old}}
    if "eval" in preset and "tasks" in preset["eval"]:
        out["eval"] = {**preset["eval"], "tasks": list(dict.fromkeys(task if t == old else t for t in preset["eval"]["tasks"]))}
    return fit_preset_models(out, task, (task_args or {}).get(task, {}))


def fit_preset_models(preset: dict, task: str, options: dict) -> dict:
    """Fit a preset's models to a task they were not chosen for: their supervised warm-up trains on reference solutions,
    so it is dropped when the task has none; a tiny model's positions grow to hold the task's episode budget
    (``max_context_tokens``). Only the preset's values change: what the user sets still wins (and is checked)."""
    from opd_harness.registry import TASKS, RegistryError

    try:
        cls = TASKS.get(task)
    except RegistryError:
        return preset  # planning names the unknown task
    field = cls.Options.model_fields.get("max_context_tokens")
    budget = options.get("max_context_tokens", field.default if field is not None else None)
    out = dict(preset)
    for role in ("student", "teacher"):
        spec = dict(out.get(role) or {})
        if spec.get("sft_steps", 0) > 0 and not cls.provides_references:
            spec["sft_steps"] = 0
            spec.pop("sft_target", None)  # no warm-up, so no quality for it to reach
        if (
            isinstance(spec.get("arch"), dict)
            and isinstance(budget, int)
            and spec["arch"].get("max_positions", TinyArch.model_fields["max_positions"].default) < budget
        ):
            spec["arch"] = {**spec["arch"], "max_positions": budget}
        if spec:
            out[role] = spec
    return out


def without_tiny_teacher(preset: dict, user: dict) -> dict:
    """A preset whose tiny teacher (``arch``, warm-up) gives way when the user picks a teacher on another backend
    (``--preset smoke --set teacher.backend=openai``): that teacher is served or loaded, never built here."""
    backend = (user.get("teacher") or {}).get("backend")
    if backend in (None, "hf") or "teacher" not in preset:
        return preset
    tiny = {"arch", "sft_steps", "sft_lr", "sft_batch_size", "seed", "sft_target"}
    return {**preset, "teacher": {k: v for k, v in preset["teacher"].items() if k not in tiny}}


def fitted_default_models(user: dict) -> dict:
    """Without a preset, RunConfig's own tiny student and teacher as a preset layer, fitted to the task as a preset's
    models are (no warm-up on a task without references, positions for its episode budget): only what the user sets is
    refused. A role whose ``path`` or ``arch`` the user gives is the user's alone, as is a teacher on another backend."""
    task = user.get("task") or RunConfig.model_fields["task"].default
    defaults = {
        role: RunConfig.model_fields[role].default_factory().model_dump(exclude_defaults=True)
        for role in ("student", "teacher")
        if not {"path", "arch"} & set(user.get(role) or {})
    }
    return without_tiny_teacher(fit_preset_models(defaults, task, (user.get("task_args") or {}).get(task, {})), user)


MODELS_HINT = "give --student MODEL --teacher MODEL (hub ids or local folders), or --preset smoke for the CPU miniature"


def names_a_model(user: dict, role: str) -> bool:
    """Whether the user's layers name ``role``'s model: a ``path`` or an ``arch``, or (teacher) another backend (served)."""
    spec = user.get(role) or {}
    if not isinstance(spec, dict):
        return True  # a malformed value: validation names it
    return bool({"path", "arch"} & set(spec)) or (role == "teacher" and spec.get("backend") not in (None, "hf"))


def without_preset_models(preset: dict, user: dict) -> dict:
    """A preset's tiny model (``arch``, warm-up) gives way to a model the user names for that role (``--student DIR``,
    ``--set teacher.path=ID``): a named model is loaded, never built or warmed up here."""
    tiny = {"arch", "path", "sft_steps", "sft_lr", "sft_batch_size", "sft_target"}
    out = dict(preset)
    for role in ("student", "teacher"):
        named = {"path", "arch"} & set((user.get(role) or {}) if isinstance(user.get(role), dict) else {})
        if named and isinstance(out.get(role), dict):
            out[role] = {k: v for k, v in out[role].items() if k not in tiny}
    return out


def selected_method_args(layer: dict, method: str) -> dict:
    """A preset's layer without its ``method_args`` for methods the run does not select (a preset may prepare several)."""
    args = layer.get("method_args")
    if not isinstance(args, dict):
        return layer
    return {**layer, "method_args": {name: value for name, value in args.items() if name == method}}


def with_training_task_evaluated(data: dict) -> dict:
    """``eval.tasks`` holds the training task: first when the list given omits it (evaluation defaults to it), unless
    the task has no test split to evaluate (a training-only prompt set), which the list given then replaces."""
    task = data.get("task", RunConfig.model_fields["task"].default)
    given = (data.get("eval") or {}).get("tasks") if isinstance(data.get("eval"), dict) else None
    if not isinstance(given, list) or not isinstance(task, str) or not given or task in given or not has_test_split(task):
        return data
    return {**data, "eval": {**data["eval"], "tasks": [task, *given]}}


def has_test_split(task: str) -> bool:
    """Whether the registered task ``task`` can be evaluated (it has a ``test`` split); an unknown name counts as one, so
    that planning the run names it."""
    from opd_harness.registry import TASKS, RegistryError

    try:
        return "test" in TASKS.get(task).splits
    except RegistryError:
        return True


def user_layers(config_file: Path | None = None, overrides: list[str] = (), cli: dict | None = None) -> dict:
    """The user's layers merged: config file < ``--set`` < explicit flags."""
    user: dict = {}
    if config_file:
        user = deep_merge(user, load_yaml_file(config_file))
    for item in overrides:
        user = deep_merge(user, parse_override(item))
    return deep_merge(user, {k: v for k, v in (cli or {}).items() if v is not None})


def check_models_named(*, preset: str | None = None, config_file: Path | None = None, overrides: list[str] = (),
                       cli: dict | None = None) -> None:  # fmt: skip
    """``harness run``: outside a preset, a run that names neither the student nor the teacher is refused
    (:data:`MODELS_HINT`) instead of training the built-in tiny pair."""
    user = user_layers(config_file, overrides, cli)
    if not preset and not (names_a_model(user, "student") or names_a_model(user, "teacher")):
        raise ConfigError(f"no student and no teacher named: {MODELS_HINT}")


def build_config(
    *, preset: str | None = None, config_file: Path | None = None, overrides: list[str] = (), cli: dict | None = None,
    planning: bool = False,
) -> RunConfig:
    """Merge the layers and validate; raises :class:`ConfigError` naming the bad key. ``planning``: the config is only
    printed or planned here (``--print-config``, ``--dry-run``), so what this host lacks (a CUDA device) is not refused;
    a config built so must not be run."""
    user = user_layers(config_file, overrides, cli)
    if preset:
        retargeted = retarget_preset(load_preset(preset), user.get("task"), user.get("task_args"))
        base = without_preset_models(without_tiny_teacher(retargeted, user), user)
        method = user.get("method", base.get("method", RunConfig.model_fields["method"].default))
        data = deep_merge(selected_method_args(base, method), user)
    else:
        data = deep_merge(fitted_default_models(user), user)
    try:
        return RunConfig.model_validate(with_training_task_evaluated(data), context={PLANNING: planning})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, RunConfig)) from None
