"""A memory plan of a run before anything runs (``harness run … --dry-run``): per role and per device, the bytes of
weights, gradients, optimizer state, activations, the teacher signal, buffered batches and the rollout KV cache.

Model shapes come from config files (a local folder's ``config.json``, the hub's through ``AutoConfig``, or the
published shapes of :mod:`opd_harness.models.shapes`), never from loaded weights; parameter counts are computed from the
shape. Each term is a small pure function of the shape and the config; :func:`build_memory_plan` puts them together
for a validated :class:`~opd_harness.plan.Plan` and :func:`fit_failure` checks them against the devices' capacity.
The formulas, what they leave out, and the CPU measurements they were checked against: ``docs/memory-plan.md``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd_harness.errors import ConfigError
from opd_harness.models.hub import hub_config, hub_unavailable, looks_like_hub_id
from opd_harness.teacher_signal import bytes_per_token

if TYPE_CHECKING:
    from opd_harness.config import ModelSpec, RunConfig
    from opd_harness.plan import Plan

GIB = 1024**3
FP32 = 4
PROMPT_TOKENS = 512  # prompt allowance of a single-turn task's row (its max_new_tokens come on top); stated in the plan
DEFAULT_VLLM_UTILIZATION = 0.5  # VLLMBackend.load's default gpu_memory_utilization
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}

# The learner's (tokens, V) float32 tensors (multiples of tokens × V × 4 bytes), read from trainers/learner.py and
# harness/backends/hf.py scores_from_logits, then checked against CPU peaks (docs/memory-plan.md). "Kept" is per token of
# the graph: the step's rows with one graph, one bucket's with the per-bucket backward (trainer.bucket_backward).
# sampled-token log-probs: the log-softmax and its exp (entropy) are kept for every bucket of the step's one graph,
# and one bucket's logits and exp·logp product exist beside them while it is computed.
VOCAB_KEPT_SAMPLED, VOCAB_TRANSIENT_SAMPLED = 2, 2
# the full student distribution (unchunked): the log-softmax, its padded copy (the distribution), and the objective's
# exp and difference are kept; the bucket's logits, the entropy's exp and product, and the backward's gradients pass by.
VOCAB_KEPT_FULL, VOCAB_TRANSIENT_FULL = 4, 3
# the per-bucket backward's first pass, unchunked full distribution (no graph; freed before the buckets' backwards, so the
# peak is the larger of this and one bucket's): this rank's (tokens, V) log-distribution kept for the objective, the
# teacher's distribution and the exp, difference and product computing a recorded term from both
VOCAB_FIRST_PASS_FULL = 5
# (chunk, V) float32 tensors alive at once for a chunk of positions under checkpointing, fitted to the CPU peaks of
# benchmarks/memory_plan_check.py (shapes D, F, G): the student's logits, log-softmax, exp and entropy/log-prob terms with
# their gradients in the recompute; a full teacher signal adds its log-distribution.
VOCAB_CHUNK_COPIES = 10
TEACHER_CHUNK_COPIES = 1


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a decoder-only transformer (Qwen3/Llama layout), and where it was read. A
    mixture-of-experts model (Qwen3-MoE) has ``moe_layers`` sparse layers of ``experts`` SwiGLU experts of width
    ``expert_intermediate`` with ``experts_per_token`` routed per token; its other layers are dense (``intermediate``)."""

    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0


@dataclass
class Term:
    """One line of the plan: ``bytes`` of ``term`` for one replica of ``role`` on ``device`` (None: a share of an
    unknown capacity, ``share`` of the device)."""

    role: str
    device: str
    term: str
    bytes: int | None
    note: str = ""
    share: float | None = None


@dataclass
class Device:
    """A device of the plan: what one replica of its roles sees (``capacity`` None: unknown, nothing checked)."""

    name: str
    roles: list[str]
    replicas: int
    capacity: int | None


@dataclass
class MemoryPlan:
    """The plan: its terms, its devices, and the assumptions it was made under (shape sources, row lengths, ...)."""

    terms: list[Term] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    def total(self, device: str) -> int:
        """The bytes of every term on ``device`` (a share of an unknown capacity counts 0)."""
        return sum(t.bytes or 0 for t in self.terms if t.device == device)

    def to_dict(self) -> dict:
        """JSON form: terms, devices with their totals and capacity, assumptions."""
        devices = [{**asdict(d), "total_bytes": self.total(d.name), "fits": fits(self.total(d.name), d.capacity)} for d in self.devices]
        return {"terms": [asdict(t) for t in self.terms], "devices": devices, "assumptions": self.assumptions}


def fits(total: int, capacity: int | None) -> bool | None:
    """Whether ``total`` bytes fit ``capacity`` (None: capacity unknown)."""
    return None if capacity is None else total <= capacity


# ---- model shapes, without weights


def layer_kinds(shape: ModelShape) -> list[tuple[bool, int]]:
    """(sparse, how many layers) for each kind of decoder layer the model has: dense and/or mixture-of-experts."""
    kinds = [(False, shape.layers - shape.moe_layers), (True, shape.moe_layers)]
    return [(sparse, count) for sparse, count in kinds if count > 0]


def mlp_parameters(shape: ModelShape, sparse: bool, *, active: bool = False) -> int:
    """Parameters of one layer's MLP: a SwiGLU (3·H·I); a sparse layer's experts (E·3·H·I_e) and router (E·H), or with
    ``active`` only the ``experts_per_token`` experts a token goes through."""
    if not sparse:
        return 3 * shape.hidden * shape.intermediate
    experts = shape.experts_per_token if active else shape.experts
    return experts * 3 * shape.hidden * shape.expert_intermediate + shape.experts * shape.hidden


def layer_parameters(shape: ModelShape, sparse: bool | None = None, *, active: bool = False) -> int:
    """Parameters of one decoder layer: q/k/v/o projections, q/k norms (Qwen3), the MLP, two RMSNorms. ``sparse`` None:
    the largest layer the model has (what FSDP2 gathers whole)."""
    if sparse is None:
        return max(layer_parameters(shape, kind, active=active) for kind, _ in layer_kinds(shape))
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = shape.hidden * q + 2 * shape.hidden * kv + q * shape.hidden + 2 * shape.head_dim
    return attention + mlp_parameters(shape, sparse, active=active) + 2 * shape.hidden


def parameter_count(shape: ModelShape, *, active: bool = False) -> int:
    """Parameters of the whole model: embedding, layers (every expert; ``active``: only those one token is routed
    through), final norm, and the output head unless tied to the embedding."""
    head = 0 if shape.tied else shape.vocab * shape.hidden
    layers = sum(count * layer_parameters(shape, sparse, active=active) for sparse, count in layer_kinds(shape))
    return shape.vocab * shape.hidden + layers + shape.hidden + head


def mlp_width(shape: ModelShape) -> int:
    """The widest per-token MLP intermediate of the model's layers: I for a dense layer, experts_per_token · I_e for a
    sparse one (what one token's forward computes)."""
    return max(shape.experts_per_token * shape.expert_intermediate if sparse else shape.intermediate for sparse, _ in layer_kinds(shape))


def describe_shape(shape: ModelShape) -> str:
    """Parameters, layers, widths and (mixture-of-experts) the experts, for the plan's assumptions."""
    moe = ""
    if shape.moe_layers:
        moe = (f", {parameter_count(shape, active=True) / 1e9:.3g}B active per token ({shape.experts} experts of "
               f"{shape.expert_intermediate}, {shape.experts_per_token} per token, in {shape.moe_layers} of {shape.layers} layers)")
    return (f"{shape.name}, {parameter_count(shape) / 1e9:.3g}B parameters{moe}, {shape.layers} layers, hidden {shape.hidden}, "
            f"vocab {shape.vocab} ({shape.source})")  # fmt: skip


# Mixture-of-experts layouts other than Qwen3-MoE's, named by a config key the plan does not model.
UNMODELLED_MOE_KEYS = {"n_routed_experts": "DeepSeek-style experts", "shared_expert_intermediate_size": "a shared expert"}


def moe_fields(config: dict, layers: int, source: str) -> dict[str, int]:
    """The expert fields of a Qwen3-MoE config: ``num_experts`` (``num_local_experts`` as transformers 5 writes it),
    ``num_experts_per_tok``, ``moe_intermediate_size``; layer i is sparse unless in ``mlp_only_layers`` or (i + 1) is not a
    multiple of ``decoder_sparse_step``, as transformers' Qwen3MoeDecoderLayer decides. {} for a dense config; another
    MoE layout (experts without ``moe_intermediate_size``, e.g. Mixtral's; DeepSeek's; a shared expert) is a ValueError."""
    for key, what in UNMODELLED_MOE_KEYS.items():
        if config.get(key):
            raise ValueError(f"{source} has {key} ({what}): the memory plan counts only Qwen3-MoE experts "
                             "(num_experts, num_experts_per_tok, moe_intermediate_size)")  # fmt: skip
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return {}
    if not config.get("moe_intermediate_size"):
        key = "num_experts" if config.get("num_experts") else "num_local_experts"
        raise ValueError(f"{source} has {key} but no moe_intermediate_size (Mixtral-style experts): the memory plan counts "
                         "only Qwen3-MoE experts (num_experts, num_experts_per_tok, moe_intermediate_size)")  # fmt: skip
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return {"experts": experts, "experts_per_token": int(config["num_experts_per_tok"]),
            "expert_intermediate": int(config["moe_intermediate_size"]), "moe_layers": sparse}  # fmt: skip


def shape_from_config(config: dict, name: str, source: str) -> ModelShape:
    """A :class:`ModelShape` from a ``config.json`` mapping (a multimodal one's ``text_config``); ``head_dim`` defaults to
    hidden / heads, ``num_key_value_heads`` to the heads; Qwen3-MoE expert fields when present (:func:`moe_fields`). A
    missing field is a ``ValueError`` naming it."""
    config = config.get("text_config", config)
    try:
        hidden, heads, layers = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
        moe = moe_fields(config, layers, source)
        every_layer_sparse = bool(moe) and moe["moe_layers"] == layers
        return ModelShape(
            name=name,
            source=source,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config.get("intermediate_size") or 0) if every_layer_sparse else int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            **moe,
        )
    except KeyError as exc:
        raise ValueError(f"{source} has no {exc.args[0]!r}") from None


def published_shape(arch: str, source: str | None = None) -> ModelShape:
    """The published Qwen3 shape ``arch`` of :data:`opd_harness.models.shapes.SHAPES`."""
    from opd_harness.models.shapes import get_shape

    s = get_shape(arch)
    return ModelShape(arch, source or f"harness/models/shapes.py ({s.source})", s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim,
                      s.intermediate, s.vocab, s.tie_word_embeddings, s.experts, s.experts_per_token, s.expert_intermediate,
                      s.layers if s.experts else 0)  # fmt: skip


def tiny_shape(arch: Any) -> ModelShape:
    """A tiny model built from ``arch`` (:class:`~opd_harness.models.tiny.TinyArch`): character tokenizer, tied embedding."""
    from opd_harness.models.tiny import CHARSET

    vocab = len(dict.fromkeys(CHARSET)) + 3  # pad, eos, unk, then one id per character (build_char_tokenizer)
    return ModelShape("tiny", "the config's arch", arch.layers, arch.hidden, arch.heads, arch.kv_heads, arch.hidden // arch.heads,
                      arch.ffn, vocab, True)  # fmt: skip


def published_hub_ids() -> dict[str, str]:
    """Hub ids whose config.json :data:`~opd_harness.models.shapes.SHAPES` copies (``Qwen/Qwen3-1.7B`` → its shape name),
    and those of :data:`~opd_harness.models.shapes.HUB_VARIANTS` (the same architectures under other checkpoints)."""
    from opd_harness.models.shapes import HUB_VARIANTS, SHAPES

    ids = {shape.source.removesuffix(" config.json"): name for name, shape in SHAPES.items()}
    return ids | {repo: name for repo, (name, _) in HUB_VARIANTS.items()}


def hub_shape(repo: str, key: str) -> ModelShape:
    """The shape of hub model ``repo``: its cached config.json, else the published shape of a Qwen3 id the harness knows,
    else the hub's config.json (network, 5 s timeout). Offline (``HF_HUB_OFFLINE``, or the hub unreachable) a one-line
    ConfigError naming ``key``."""
    from huggingface_hub import hf_hub_download

    from opd_harness.models.shapes import HUB_VARIANTS

    try:
        config = json.loads(Path(hf_hub_download(repo, "config.json", local_files_only=True)).read_text())
    except Exception:  # noqa: BLE001 - not cached (or unreadable): the published shape or the hub below
        config = None
    if config is not None:
        return shape_of_config(config, repo, f"{repo} config.json (local hub cache)", key)
    known = published_hub_ids().get(repo)
    if known is not None:
        why = f"; {HUB_VARIANTS[repo][1]}" if repo in HUB_VARIANTS else ""
        return published_shape(known, f"{repo}: not in the hub cache; the published shape {known} (harness/models/shapes.py{why})")
    hint = f"give a local model folder or a published shape ({key.rsplit('.', 1)[0]}.arch)"
    why = hub_unavailable()
    if why:
        raise ConfigError(f"{key}={repo}: {why} and its config.json is not cached; {hint}")
    try:
        config = hub_config(repo)
    except Exception as exc:  # noqa: BLE001 - unreachable hub, unknown or gated repo: one line either way
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{key}={repo}: cannot read its config.json from the hub ({first}); {hint}") from None
    return shape_of_config(config, repo, f"{repo} config.json (hub)", key)


def shape_of_config(config: dict, name: str, source: str, key: str) -> ModelShape:
    """:func:`shape_from_config`, its ValueError (a missing field, an unmodelled MoE layout) a one-line ConfigError naming ``key``."""
    try:
        return shape_from_config(config, name, source)
    except ValueError as exc:
        raise ConfigError(f"{key}={name}: cannot plan its memory ({exc})") from None


def model_shape(spec: ModelSpec, key: str) -> ModelShape:
    """The shape of the model ``spec`` names (``key``: its config key, e.g. ``student``), reading no weights."""
    if spec.arch is not None:
        return published_shape(spec.arch) if isinstance(spec.arch, str) else tiny_shape(spec.arch)
    path = str(spec.path)
    folder = Path(path).expanduser()
    if folder.is_dir():
        file = folder / "config.json"
        try:
            return shape_from_config(json.loads(file.read_text()), path, str(file))
        except (OSError, json.JSONDecodeError, ValueError) as exc:
            raise ConfigError(f"{key}.path={path}: cannot read a model shape from {file} ({exc})") from None
    if looks_like_hub_id(path):
        return hub_shape(path, f"{key}.path")
    raise ConfigError(f"{key}.path={path}: no such folder, and not a hub id of the form owner/name")


# ---- the terms


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int, dtype_bytes: int) -> int:
    """A KV cache of ``rows`` sequences of ``tokens`` (prompt + new): 2 × layers × kv_heads × head_dim × dtype × rows × tokens."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes * rows * tokens


def mlp_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int, sparse: bool) -> int:
    """What one layer's MLP keeps per token for its backward: a dense SwiGLU's gate, up, activation and product (4 I).
    A sparse layer (transformers' Qwen3MoeSparseMoeBlock, its expert loop), per routed expert: the gathered input, the
    down projection's output and the weighted output (3 H), the expert's gate, up, activation and product (4 I_e) and the
    routing weight twice, in the activation dtype, plus 24 bytes of int64 expert id and indices; and the router's float32
    probabilities over the E experts. Counted with saved-tensor hooks (``benchmarks/moe_layer_activations.py``)."""
    if not sparse:
        return dtype_bytes * 4 * shape.intermediate
    k = shape.experts_per_token
    return dtype_bytes * k * (3 * shape.hidden + 4 * shape.expert_intermediate + 2) + 24 * k + FP32 * shape.experts


def layer_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int, sparse: bool | None = None) -> int:
    """Tensors one decoder layer keeps per token for its backward (SDPA attention: no tokens² term): the two RMSNorms'
    inputs and outputs (4 H), q/k/v, their norms and rotations, the attention output (5 q + 4 kv widths), and the MLP's
    (:func:`mlp_activation_bytes_per_token`). ``sparse`` None: the model's largest layer."""
    if sparse is None:
        return max(layer_activation_bytes_per_token(shape, dtype_bytes, kind) for kind, _ in layer_kinds(shape))
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return dtype_bytes * (4 * shape.hidden + 5 * q + 4 * kv) + mlp_activation_bytes_per_token(shape, dtype_bytes, sparse)


def model_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """:func:`layer_activation_bytes_per_token` summed over every decoder layer (dense and sparse ones)."""
    return sum(count * layer_activation_bytes_per_token(shape, dtype_bytes, sparse) for sparse, count in layer_kinds(shape))


def learner_activation_bytes(
    shape: ModelShape, *, graph_tokens: int, bucket_tokens: int, dtype_bytes: int, checkpointing: bool, student_full: bool,
    vocab_chunk: int, teacher_in_chunk: bool = False, rank_tokens: int | None = None,
) -> tuple[int, int]:
    """(decoder-layer activations, output-head/vocabulary activations) of one learner step whose graph holds
    ``graph_tokens`` (every bucket of the step with one backward over all; one bucket with the per-bucket backward) and
    whose largest forward is ``bucket_tokens``. Checkpointing keeps each layer's input and recomputes one layer at a time;
    the vocabulary terms are float32; ``teacher_in_chunk``: a full teacher signal's distribution is computed in each chunk
    too. ``rank_tokens`` (the rank's tokens, per-bucket backward only): the first pass holds the student distribution of all
    of them while the objective runs, as (tokens, H) hidden states chunked or (tokens, V) log-probabilities unchunked."""
    if checkpointing:
        layers = graph_tokens * (shape.layers * shape.hidden * dtype_bytes + layer_activation_bytes_per_token(shape, dtype_bytes))
    else:
        layers = graph_tokens * model_activation_bytes_per_token(shape, dtype_bytes)
    row = shape.vocab * FP32
    first_pass = rank_tokens if rank_tokens is not None and rank_tokens > graph_tokens else 0
    if vocab_chunk:  # every method: the head runs a chunk of positions at a time (the full terms too when the method reads them)
        copies = VOCAB_CHUNK_COPIES + (TEACHER_CHUNK_COPIES if teacher_in_chunk else 0)
        kept = first_pass if student_full else 0  # a full reader's first pass keeps the rank's hidden states for its terms
        vocab = (kept + graph_tokens) * shape.hidden * FP32 + copies * min(vocab_chunk, graph_tokens) * row
    elif student_full:
        vocab = max((VOCAB_KEPT_FULL * graph_tokens + VOCAB_TRANSIENT_FULL * bucket_tokens) * row, VOCAB_FIRST_PASS_FULL * first_pass * row)
    else:
        vocab = (VOCAB_KEPT_SAMPLED * graph_tokens + VOCAB_TRANSIENT_SAMPLED * bucket_tokens) * row
    return layers, vocab


def one_graph_bytes(
    shape: ModelShape, *, graph_tokens: int, bucket_tokens: int, dtype_bytes: int, checkpointing: bool, student_full: bool,
    vocab_chunk: int, vocab_tokens: int | None = None,
) -> int:
    """Activation bytes of a learner step that keeps one graph over ``graph_tokens`` (all its buckets): the sum of
    :func:`learner_activation_bytes`; what ``trainer.graph_memory_gib`` is compared with to choose the per-bucket backward.
    ``vocab_tokens`` (unchunked): the positions the output head and the vocabulary terms run on (the loss's, not every
    bucketed token), all of them at once: their (tokens, V) tensors are counted kept and passing."""
    layers, vocab = learner_activation_bytes(shape, graph_tokens=graph_tokens, bucket_tokens=bucket_tokens, dtype_bytes=dtype_bytes,
                                             checkpointing=checkpointing, student_full=student_full, vocab_chunk=vocab_chunk)  # fmt: skip
    if vocab_tokens is not None and not vocab_chunk:
        vocab = learner_activation_bytes(shape, graph_tokens=vocab_tokens, bucket_tokens=vocab_tokens, dtype_bytes=dtype_bytes,
                                         checkpointing=checkpointing, student_full=student_full, vocab_chunk=0)[1]  # fmt: skip
    return layers + vocab


def first_pass_bytes(*, step_tokens: int, student_full: bool) -> int:
    """What the per-bucket backward's first pass keeps while the buckets' backwards run: the global (B, T) float32
    log-probs, entropy, their gradient and this rank's slice of it (×W), and a full-distribution method's recorded terms
    and their gradients (counted as 4 more (B, T) tensors: terms of a few values per position)."""
    return (5 + (4 if student_full else 0)) * step_tokens * FP32


def learner_state_terms(shape: ModelShape, *, ranks: int, sharding: str, precision: str) -> dict[str, tuple[int, str]]:
    """Weights, gradients and AdamW state of one learner rank (fp32 master weights; bf16 is autocast, whose bf16 copies
    of the weights are kept for the backward). DDP: a full copy per rank; FSDP2: divided by the ranks, plus one layer's
    parameters gathered whole."""
    params = parameter_count(shape)
    shard = sharding == "fsdp2" and ranks > 1
    divide = ranks if shard else 1
    gathered = layer_parameters(shape) * FP32 if shard else 0
    where = f"/ {ranks} ranks (fsdp2)" if shard else "full copy per rank" if ranks > 1 else ""
    out = {
        "weights": (params * FP32 // divide + gathered, f"{params / 1e9:.3g}B params × 4 B {where}".strip()),
        "gradients": (params * FP32 // divide, f"fp32 {where}".strip()),
        "optimizer": (params * 2 * FP32 // divide, f"AdamW: 2 fp32 moments {where}".strip()),
    }
    if precision == "bf16":
        out["bf16 weight copies"] = (params * 2, "autocast's bf16 casts, kept for the backward")
    return out


# ---- the run's inputs


def signal_kind(cfg: RunConfig, accepted: tuple[str, ...]) -> str:
    """The run's teacher signal: ``teacher.signal`` as the plan resolved it, or (still ``auto``) the first kind the method
    accepts; ``sampled`` for a method that reads no teacher distribution."""
    chosen = cfg.teacher.signal
    if chosen != "auto":
        return chosen
    return accepted[0] if accepted else "sampled"


def row_tokens(task: Any, cfg: RunConfig) -> tuple[int, str]:
    """Tokens of one trajectory row: the task's episode budget (``max_context_tokens``) when it has one, else a
    prompt allowance plus the new tokens; and how it was chosen."""
    budget = getattr(task.options, "max_context_tokens", None)
    if budget:
        return int(budget), f"task_args.{task.name}.max_context_tokens"
    new = cfg.trainer.max_new_tokens or task.options.max_new_tokens
    return PROMPT_TOKENS + new, f"{PROMPT_TOKENS} prompt tokens (assumed) + {new} new tokens"


def cuda_capacity() -> int | None:
    """Memory of this host's first CUDA device, when torch sees one (nothing is allocated on it)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def vllm_share(options: dict) -> float:
    """The device share a vLLM engine takes (``gpu_memory_utilization``)."""
    return float(options.get("gpu_memory_utilization", DEFAULT_VLLM_UTILIZATION))


# ---- the plan


def build_memory_plan(plan: Plan, device_memory_gib: float | None = None) -> MemoryPlan:
    """The memory plan of a validated run plan; ``device_memory_gib`` is each accelerator's memory (default: this host's
    CUDA device, else unknown)."""
    cfg = plan.config
    trainer = cfg.trainer
    needs = plan.method.needs(plan.hparams)
    out = MemoryPlan()
    student = model_shape(cfg.student, "student")
    teacher = None if cfg.teacher.backend == "openai" else model_shape(cfg.teacher, "teacher")
    for label, shape in (("student", student), ("teacher", teacher)):
        if shape is not None:
            out.assumptions.append(f"{label}: {describe_shape(shape)}")
    tokens, how = row_tokens(plan.task, cfg)
    rows = trainer.prompts_per_step * trainer.samples_per_prompt
    layout = trainer.layout if trainer.executor == "ray" else None
    ranks = layout.learner.replicas if layout is not None else 1
    sharding = layout.learner.sharding if layout is not None else "ddp"
    rank_rows = -(-rows // ranks)
    rank_tokens = rank_rows * tokens
    bucket = min(rank_tokens, max(trainer.forward_tokens, tokens)) if trainer.forward_tokens else rank_tokens
    precision_bytes = 2 if trainer.precision == "bf16" else FP32
    whole = one_graph_bytes(student, graph_tokens=rank_tokens, bucket_tokens=bucket, dtype_bytes=precision_bytes,
                            checkpointing=trainer.activation_checkpointing, student_full="student_full" in needs,
                            vocab_chunk=trainer.vocab_chunk)  # fmt: skip
    per_bucket = trainer.bucket_backward and bucket < rank_tokens and whole > trainer.graph_memory_gib * GIB
    graph = bucket if per_bucket else rank_tokens
    out.assumptions.append(f"rows of {tokens} tokens ({how}); {rows} rows per step, {rank_rows} per learner rank")
    if per_bucket:
        out.assumptions.append(f"the learner's backward runs per forward_tokens bucket (trainer.bucket_backward): one graph of "
                               f"{bucket} tokens at a time, out of {rank_tokens} per rank")  # fmt: skip
    else:
        out.assumptions.append(f"the learner keeps one graph over its {rank_tokens} tokens (one backward); largest forward {bucket} tokens")

    capacity = int(device_memory_gib * GIB) if device_memory_gib is not None else cuda_capacity()
    accel_kind = "cuda" if capacity is not None and device_memory_gib is None else "gpu"

    devices: dict[str, Device] = {}

    def device_of(role: str) -> Device:
        """The device one replica of ``role`` runs on (registered in the plan at its first term)."""
        local = trainer.device if trainer.device != "auto" else ("cuda" if cuda_capacity() is not None else "cpu")
        if layout is None and not (role == "buffer" and local != "cpu"):  # in process: every role on trainer.device
            vllm = (role == "rollout" and trainer.rollout_backend == "vllm") or (role == "teacher" and cfg.teacher.backend == "vllm")
            name, cap, replicas = f"{local} (in process)", capacity, 1
            if vllm and local == "cpu":  # a vLLM engine starts on the driver's GPU
                name = f"{accel_kind} ({role}, vllm in the driver)"
        elif role == "buffer":  # batches wait off the accelerator
            name, cap, replicas = "host (driver)", None, 1
        else:
            placed = getattr(layout, role)
            on_gpu = placed.num_gpus > 0
            name = f"{accel_kind} ({role})" if on_gpu else f"cpu ({role} host)"
            cap, replicas = (capacity if on_gpu else None), placed.replicas
        device = devices.setdefault(name, Device(name, [], replicas, cap))
        if role not in device.roles:
            device.roles.append(role)
        return device

    def add(role: str, term: str, size: int | None, note: str = "", share: float | None = None) -> None:
        out.terms.append(Term(role, device_of(role).name, term, size, note, share))

    # learner
    for term, (size, note) in learner_state_terms(student, ranks=ranks, sharding=sharding, precision=trainer.precision).items():
        add("learner", term, size, note)
    student_full = "student_full" in needs
    kind = signal_kind(cfg, plan.method.accepted_signals(plan.hparams))
    layers_b, vocab_b = learner_activation_bytes(
        student, graph_tokens=graph, bucket_tokens=bucket, dtype_bytes=precision_bytes,
        checkpointing=trainer.activation_checkpointing, student_full=student_full, vocab_chunk=trainer.vocab_chunk,
        teacher_in_chunk=kind == "full", rank_tokens=rank_tokens,
    )  # fmt: skip
    ckpt = "checkpointed, " if trainer.activation_checkpointing else ""
    one = "one bucket: " if per_bucket else ""
    add("learner", "activations (layers)", layers_b, f"{one}{ckpt}{graph} tokens × {student.layers} layers")
    chunked = bool(trainer.vocab_chunk)
    vocab_note = f"float32 (tokens, {student.vocab}): {'full distribution' if student_full else 'sampled-token log-probs'}"
    add("learner", "activations (vocab)", vocab_b, one + (f"chunks of {trainer.vocab_chunk} positions" if chunked else vocab_note))
    if per_bucket:
        add("learner", "first pass (kept)", first_pass_bytes(step_tokens=rows * tokens, student_full=student_full),
            "the step's (B, T) log-probs, entropy and their gradients" + (", recorded vocabulary terms" if student_full else ""))
    top_k = cfg.teacher.top_k
    signal_dtype = DTYPE_BYTES.get(cfg.teacher.signal_dtype, FP32)
    hidden = teacher.hidden if teacher is not None else student.hidden
    per_token = bytes_per_token(kind, hidden=hidden, top_k=top_k, dtype_bytes=signal_dtype)
    batch_tokens = rows * tokens
    base_per_token = 4 * 8 + 2 * FP32  # ids, attention, step index (int64) + loss mask, behaviour log-probs (the teacher's: the signal)
    add("learner", "teacher signal (one batch)", (per_token + base_per_token) * batch_tokens,
        f"{kind}: {per_token} B/token (+ {base_per_token} of ids, masks, log-probs) × {batch_tokens} tokens, the global batch")  # fmt: skip
    if kind == "full":
        add("learner", "teacher output head", student.vocab * hidden * signal_dtype, "one copy of the teacher's V × H head")
    out.assumptions.append(f"teacher signal: {kind} ({per_token} bytes/token)")

    if trainer.mode == "async":  # batches made ahead of the learner (sync: only the batch being trained on)
        buffered = trainer.max_lag + 1
        add("buffer", "buffered batches", buffered * (per_token + base_per_token) * batch_tokens, f"{buffered} batches (max_lag + 1)")

    # rollout
    rollout_rows = min(trainer.generate_batch_size, rows)
    if trainer.rollout_backend == "vllm":
        share = vllm_share(trainer.rollout_backend_options)
        add("rollout", "vllm engine", int(share * capacity) if capacity else None,
            f"gpu_memory_utilization {share:g} of the device (weights, KV cache, graphs)", share)  # fmt: skip
    else:
        if layout is not None:
            add("rollout", "weights", parameter_count(student) * FP32, "the student in float32")
        add("rollout", "kv cache", kv_cache_bytes(student, rollout_rows, tokens, FP32),
            f"{rollout_rows} rows × {tokens} tokens, float32")  # fmt: skip

    # teacher
    if cfg.teacher.backend == "vllm":
        share = vllm_share(cfg.teacher.backend_options)
        add("teacher", "vllm engine", int(share * capacity) if capacity else None,
            f"gpu_memory_utilization {share:g} of the device", share)  # fmt: skip
    elif cfg.teacher.backend == "hf" and teacher is not None:
        add("teacher", "weights", parameter_count(teacher) * FP32, f"{parameter_count(teacher) / 1e9:.3g}B params, float32")
        score = min(batch_tokens, max(trainer.forward_tokens, tokens)) if trainer.forward_tokens else batch_tokens
        chunk = trainer.vocab_chunk  # the teacher scores in chunks too, in process and as a Ray actor
        logits_tokens = min(chunk, score) if chunk else score
        add("teacher", "scoring (no grad)", 2 * logits_tokens * teacher.vocab * FP32
            + score * 2 * (teacher.hidden + mlp_width(teacher)) * FP32,
            f"logits and log-softmax of {logits_tokens} tokens")  # fmt: skip
        add("teacher", "teacher signal (one batch)", per_token * batch_tokens, f"{kind}, before it leaves the teacher")
    else:
        out.assumptions.append(f"teacher: backend {cfg.teacher.backend} (served elsewhere, not on a device of this plan)")

    # evaluation workers, where placed
    if layout is not None and layout.eval is not None:
        eval_rows = min(trainer.generate_batch_size, 64)
        add("eval", "weights", parameter_count(student) * FP32, "the checkpoint's student in float32")
        add("eval", "kv cache", kv_cache_bytes(student, eval_rows, tokens, FP32), f"{eval_rows} rows × {tokens} tokens")

    out.devices = list(devices.values())
    if capacity is None:
        out.assumptions.append("device capacity unknown (no --device-memory and no CUDA device here): nothing checked")
    return out


def fit_failure(plan: MemoryPlan) -> str | None:
    """One line naming the first device whose roles do not fit: role, estimate, capacity and the largest term; or None."""
    for device in plan.devices:
        total = plan.total(device.name)
        if device.capacity is None or fits(total, device.capacity):
            continue
        terms = [t for t in plan.terms if t.device == device.name]
        largest = max(terms, key=lambda t: t.bytes or 0)
        others = [role for role in device.roles if role != largest.role]
        role = largest.role + (f" (with {', '.join(others)})" if others else "")
        return (f"memory plan: {role} on {device.name} needs ~{total / GIB:.1f} GiB of {device.capacity / GIB:.1f} GiB; "
                f"largest term: {largest.term} {(largest.bytes or 0) / GIB:.1f} GiB")  # fmt: skip
    return None


def gib(size: int | None, share: float | None = None) -> str:
    """``size`` in GiB for the table (a share of an unknown device as a percentage)."""
    if size is None:
        return f"{share:.0%} of device" if share is not None else "?"
    return f"{size / GIB:.2f}"


def render_rows(plan: MemoryPlan) -> list[list[str]]:
    """The table's rows: role, device, term, GiB, note; then one total row per device against its capacity."""
    rows = [[t.role, t.device, t.term, gib(t.bytes, t.share), t.note] for t in plan.terms]
    for device in plan.devices:
        total = plan.total(device.name)
        cap = "capacity unknown" if device.capacity is None else f"of {device.capacity / GIB:.1f} GiB: " + (
            "fits" if fits(total, device.capacity) else "DOES NOT FIT")
        count = f" × {device.replicas}" if device.replicas > 1 else ""
        rows.append(["total", device.name + count, "per device", f"{total / GIB:.2f}", cap])
    return rows
