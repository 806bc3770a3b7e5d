"""vLLM offline-engine backend (``--backend vllm``): fast sampling and teacher scoring on a CUDA GPU.

vLLM is **not** a dependency of the CPU environment: ``vllm==0.33.0`` is a CUDA-only wheel that pins
``torch==2.14.0`` and ``transformers<5.21`` (see DEVELOPERS.md, "GPU environment"). This module
therefore imports ``vllm`` only inside :meth:`VLLMBackend.load` (and the methods that need its
classes); importing it, or the backend registry, never imports vllm or initialises CUDA. Without
vllm, ``load()`` raises a ``RuntimeError`` that says how to install it.

``VLLMBackend.load(model, ...)`` options (strings are accepted, as a command line passes them):

* ``tensor_parallel_size`` (1), ``gpu_memory_utilization`` (0.5: leaves room for a trainer on the
  same GPU), ``dtype`` ("auto"; vLLM's "auto" runs float32 checkpoints in half precision, so pass
  ``float32`` when log-probs must match the HF backend closely), ``max_model_len`` (None: from
  the model config), ``seed`` (0: the engine seed; per-request seeds come from ``SamplingParams``),
  ``enforce_eager`` (False: CUDA graphs on), ``max_logprobs`` (20: the engine's cap on
  ``logprobs``/``prompt_logprobs``; raise it to score with ``top_k`` > 20),
  ``enable_prefix_caching`` (None: vLLM's default), ``show_progress`` (False);
  anything else is passed to ``vllm.LLM`` unchanged (``load_format``, ``quantization``, ...).

How our contract maps onto vLLM (evidence in the docstrings below and in the closing report):

* **Prompts** are token ids: one ``TokensPrompt(prompt_token_ids=...)`` per prompt, all sent in a
  single ``LLM.generate(prompts, [SamplingParams per prompt], use_tqdm=...)`` call; outputs come
  back in input order and carry ``n`` ``CompletionOutput``s each (``.index``, ``.token_ids``,
  ``.text``, ``.logprobs``, ``.finish_reason``), so the result is prompt-major.
* **Seeds**: with ``params.seed`` every prompt gets its own request seed,
  :func:`opd_harness.backends.prompt_seed` (``params.seeds[prompt_index]`` when given, the rollout's
  per-episode seeds, else ``derive_seed(seed, prompt_index)``; so it, hf and the openai backend seed
  alike); vLLM gives the ``n`` children of a seeded request the seeds ``seed + i``
  (``vllm/v1/engine/parallel_sampling.py``), so the samples of one prompt differ, two prompts with
  the same text differ, and a run repeats exactly. Without ``params.seed`` sampling is unseeded.
* **Greedy**: ``temperature == 0`` is sent as ``temperature=0.0`` (vLLM's greedy). vLLM refuses
  ``n > 1`` with greedy sampling ("n must be 1 when using greedy sampling",
  ``SamplingParams._verify_greedy_sampling``), so a greedy request is sent with ``n=1`` and its one
  completion is copied ``n`` times (greedy samples are identical, as with the HF backend).
* **Top-k and presence penalty**: ``SamplingParams.top_k`` is sent as vLLM's ``top_k`` only when it is on (> 0):
  vLLM's "off" value was -1 in older releases and is 0 (or -1) in newer ones, so leaving it out is off in both.
  ``presence_penalty`` is sent when not 0 (vLLM applies it to the generated tokens, as OpenAI does).
* **Checked before sending** (``check_sampling_params``): vLLM refuses ``temperature > 2`` and an
  empty stop string, and silently raises ``0 < temperature < 0.01`` to 0.01; our
  ``SamplingParams`` allows all three, so this backend refuses them with a ``ValueError`` first.
* **Log-probs of sampled tokens**: ``SamplingParams(logprobs=0)`` returns, per generated token, a
  dict ``{token_id: Logprob}`` holding just the sampled token (vLLM always includes it). Which
  distribution those numbers come from is an *engine* setting in vLLM >= 0.10,
  ``LLM(logprobs_mode=...)`` (``ModelConfig.logprobs_mode``; it is not a per-request
  ``SamplingParams`` field): ``raw_logprobs`` (the default) is the log-softmax of the model's logits
  *before* temperature, top-p/top-k, penalties and any logits processor; ``processed_logprobs``
  would be after them. Our contract is log π under the untempered model distribution, so this
  backend always starts the engine with ``logprobs_mode="raw_logprobs"`` and refuses any other
  mode. (Older vLLM V0 returned processed log-probs; 0.33 is V1-only.)
* **EOS and stops**: vLLM stops on the tokenizer's/generation config's EOS and keeps the EOS id as
  the last of ``token_ids`` (its text is dropped by ``skip_special_tokens``), as the HF backend
  does. Stop strings are sent with ``include_stop_str_in_output=True`` so the text keeps the stop
  string, again like the HF backend. ``finish_reason`` "length" stays "length"; "stop" (EOS,
  stop string or stop token) is "stop"; anything else (an aborted request) is an error.
* **Scoring** (``score``): each unpadded sequence is sent as a prompt with
  ``SamplingParams(max_tokens=1, prompt_logprobs=k)``; ``RequestOutput.prompt_logprobs`` is a list
  aligned with the prompt whose first entry is ``None`` (no prefix) and whose entry ``t`` is a dict
  ``{token_id: Logprob}`` holding the actual token ``t`` plus the ``k`` most likely tokens at that
  position (``Logprob.logprob``, ``Logprob.rank``). Prompt log-probs follow ``logprobs_mode`` too,
  so they are raw (untempered). Fields: ``logprobs`` and ``topk`` (``topk_logprobs``,
  ``topk_ids``); ``entropy`` and ``full`` raise ``NotImplementedError`` because vLLM returns
  only top-k log-probs, never whole distributions. vLLM refuses a prompt of exactly
  ``max_model_len`` tokens (it would leave no room for the one output token,
  ``InputProcessor._validate_prompt_len``), so such a row is sent without its last token and with
  ``allowed_token_ids=[last token]``, ``logprobs=k``: the one generated token is then the row's last
  token, and its log-prob entry (raw, computed before the allowed-token mask) is that position's
  score. A row longer than ``max_model_len`` is a ``ValueError`` naming the row.
* **Weight updates** (``load_weights``), in memory through vLLM 0.33's weight-transfer API, never a file: the engine
  is started with ``weight_transfer_config={"backend": "ipc"}`` (``vllm/config/weight_transfer.py``; the worker
  builds ``IPCWeightTransferEngine``, ``vllm/distributed/weight_transfer/ipc_engine.py``) and
  ``worker_extension_cls`` = :class:`opd_harness.backends.vllm_worker.WeightCheck`. Each update casts the state
  dict (HF names) to the engine's dtype, copies it onto each of the engine's GPUs (one transient copy per GPU, held
  until the update finishes, as vLLM's own unpacked IPC sender does) and exports CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor``, keyed by the GPU's UUID); then
  ``LLM.init_weight_transfer_engine({"init_info": {"packed": False}})`` (first time only),
  ``LLM.start_weight_update()`` (layerwise reload set up), ``LLM.update_weights({"update_info": {"names",
  "dtype_names", "shapes", "ipc_handles"}})`` (each worker rebuilds the tensors on its GPU and calls the model's own
  ``load_weights``, which maps HF names onto vLLM's fused, sharded parameters) and
  ``LLM.finish_weight_update(weight_version=str(version))``. The handles hold Python types, so this needs
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set by ``load`` unless already set) for the engine core's msgpack.
* **What is checked after every update** (:func:`check_engine_load`): vLLM has reports of reloads that silently keep
  stale weights (vllm-project/vllm#32718; #48312 "Weight Reload Correctness for RL"). Before and after the update
  every worker hashes a few of its parameters, chosen among those that keep their HF name and full shape in vLLM
  (norms; at tensor parallel 1 also the row-parallel projections and embeddings), with
  :func:`opd_harness.backends.weight_check.checksum`; each must equal the same hash of the sent state dict. A worker
  whose hash did not change is a stale load; any other mismatch a corrupt one; both raise ``WeightSyncError`` and the
  run fails. A model where no parameter keeps its HF name and shape cannot be checked and is refused. Only after a
  verified load are the prefix cache reset (``reset_prefix_cache()`` must return True: cached KV was computed with
  the old weights), ``version`` bumped and ``loaded_checksum`` set to the learner's checksum of the state dict it was
  handed (the rollout compares it with the learner's, :func:`opd_harness.trainers.weight_sync.check_loaded`).
  **Not run on a GPU here** (no machine this project has used has one); the CPU tests drive the same calls against a
  stand-in engine (``tests/fake_vllm.py``) whose every method is checked against vLLM 0.33.0's signatures
  (``tests/test_vllm_api.py``), and the GPU tests cover it where vllm and CUDA are installed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from opd_harness.backends import MAX_TEMPERATURE, MIN_TEMPERATURE, SCORE_FIELDS, Completion, SamplingParams, as_bool, prompt_seed
from opd_harness.backends.prompt_logprobs import logprob_value, prompt_logprobs_to_tensor, unpadded_sequences
from opd_harness.backends.vllm_worker import EXTENSION
from opd_harness.backends.weight_check import WeightSyncError, checked_names, checksum

VLLM_MISSING = (
    "the vllm backend needs the `vllm` package, which is not installed in this environment. vLLM is CUDA-only and pins "
    "torch==2.14.0 and transformers<5.21, so it cannot share the CPU environment: install the gpu extra in a separate "
    "environment on a GPU machine (`pip install -e '.[gpu]'`, vllm==0.33.0); see DEVELOPERS.md, 'GPU environment'"
)
RAW_LOGPROBS = "raw_logprobs"
UNSUPPORTED_SCORE_FIELDS = ("entropy", "full", "hidden", "at_ids")
WEIGHT_TRANSFER = {"backend": "ipc"}  # vLLM's colocated in-memory weight transfer (CUDA IPC handles)
OWNED_ENGINE_OPTIONS = ("weight_transfer_config", "worker_extension_cls")  # set by this backend: refused from the caller


def import_vllm():
    """The ``vllm`` module, or a ``RuntimeError`` saying how to get it."""
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError(VLLM_MISSING) from exc
    return vllm


# ---------------------------------------------------------------------------- pure helpers (no vllm)


def sampling_kwargs(params: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` for prompt ``prompt_index``.

    ``logprobs=0`` asks for the sampled token's log-prob only; a seeded run gives every prompt its
    own seed (vLLM then seeds the ``n`` samples ``seed + i``).
    """
    kwargs: dict[str, Any] = {
        "n": 1 if params.greedy else params.n,  # vLLM refuses greedy n > 1; generate() copies the one completion
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "include_stop_str_in_output": True,
        "skip_special_tokens": True,
    }
    if params.greedy:
        kwargs.update(temperature=0.0, top_p=1.0)
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p)
        if params.top_k:  # only when on: vLLM's "off" is -1 in older releases and 0 (or -1) in newer ones
            kwargs["top_k"] = params.top_k
    if params.presence_penalty:
        kwargs["presence_penalty"] = params.presence_penalty
    if params.seed is not None:
        kwargs["seed"] = prompt_seed(params, prompt_index)
    if params.stop:
        kwargs["stop"] = list(params.stop)
    return kwargs


def check_sampling_params(params: SamplingParams) -> None:
    """Refuse, with the reason, what vLLM would refuse or silently change (see the module docstring)."""
    if params.temperature > MAX_TEMPERATURE:
        raise ValueError(f"vllm backend: temperature={params.temperature} is above vLLM's limit of {MAX_TEMPERATURE}")
    if 0.0 < params.temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"vllm backend: temperature={params.temperature} is below {MIN_TEMPERATURE}, which vLLM silently raises to {MIN_TEMPERATURE}; "
            "use 0 (greedy) or at least 0.01"
        )
    if any(stop == "" for stop in params.stop):
        raise ValueError(f"vllm backend: an empty stop string is refused by vLLM; stop={list(params.stop)!r}")


def score_sampling_kwargs(want: tuple[str, ...], top_k: int) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for scoring: one throw-away token, prompt log-probs."""
    return {
        "n": 1,
        "max_tokens": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": 0,
        "prompt_logprobs": top_k if "topk" in want else 0,
        "detokenize": False,
    }


def last_token_kwargs(want: tuple[str, ...], top_k: int, last_token: int) -> dict[str, Any]:
    """Scoring kwargs for a row sent without its last token: the one output token is forced to be it.

    ``allowed_token_ids`` masks the logits after vLLM computed the raw log-probs, so the returned
    entry holds the last token's untempered log-prob and the ``k`` most likely tokens there.
    """
    kwargs = score_sampling_kwargs(want, top_k)
    kwargs.update(allowed_token_ids=[int(last_token)], logprobs=kwargs["prompt_logprobs"])
    return kwargs


def check_row_lengths(lengths: list[int], max_model_len: int | None) -> None:
    """A row longer than the engine's context cannot be scored: say which one and what to change."""
    if max_model_len is None:
        return
    for row, length in enumerate(lengths):
        if length > max_model_len:
            raise ValueError(
                f"vllm backend: score() row {row} has {length} tokens, more than the engine's max_model_len={max_model_len}; "
                f"load the vllm backend with max_model_len={length} or more"
            )


def check_score_request(want: tuple[str, ...], top_k: int, max_logprobs: int | None = None) -> None:
    """Refuse what this backend cannot score, with the reason."""
    unknown = set(want) - set(SCORE_FIELDS)
    if unknown:
        raise ValueError(f"unknown score fields {sorted(unknown)}; allowed: {SCORE_FIELDS}")
    unsupported = [f for f in UNSUPPORTED_SCORE_FIELDS if f in want]
    if unsupported:
        raise NotImplementedError(
            f"the vllm backend cannot score {unsupported}: vLLM returns only the top-k log-probs per position "
            "(prompt_logprobs), never the full distribution needed for entropy or full; use the hf backend for them"
        )
    if "topk" in want:
        if top_k < 1:
            raise ValueError(f"score(want=('topk', ...)) needs top_k >= 1, got {top_k}")
        if max_logprobs is not None and max_logprobs >= 0 and top_k > max_logprobs:
            raise ValueError(
                f"top_k={top_k} exceeds the engine's max_logprobs={max_logprobs}; load the vllm backend with max_logprobs={top_k} or more"
            )


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-token ``{token_id: Logprob}`` dicts."""
    if logprobs is None:
        return []
    if len(logprobs) < len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} log-prob entries for {len(token_ids)} tokens")
    out = []
    for position, (token, entry) in enumerate(zip(token_ids, logprobs)):
        if entry is None or token not in entry:
            raise ValueError(f"vLLM's log-probs at output position {position} lack the sampled token {token}")
        out.append(logprob_value(entry[token]))
    return out


def finish_reason(reason: str | None) -> str:
    """vLLM's finish reason in our vocabulary: "length" or "stop"."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop"
    raise RuntimeError(f"vllm backend: a request finished with reason {reason!r} (aborted or unfinished)")


def to_completion(output, prompt_index: int, sample_index: int, eos_id: int | None, timings: dict[str, float] | None = None) -> Completion:
    """One vLLM ``CompletionOutput`` (duck-typed: ``token_ids``, ``logprobs``, ``text``, ``finish_reason``) as a Completion.

    The EOS id stays in ``token_ids`` (vLLM keeps it; the loss covers it). Should anything follow a
    first EOS (it cannot with vLLM's stopping rules), it is cut off there and the reason is "stop".
    """
    token_ids = [int(t) for t in output.token_ids]
    logprobs = sampled_logprobs(token_ids, getattr(output, "logprobs", None))
    reason = finish_reason(getattr(output, "finish_reason", None))
    if eos_id is not None and eos_id in token_ids[:-1]:
        cut = token_ids.index(eos_id) + 1
        token_ids, logprobs, reason = token_ids[:cut], logprobs[:cut], "stop"
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        text=output.text or "",
        finish_reason=reason,
        prompt_index=prompt_index,
        sample_index=sample_index,
        timings=dict(timings or {}),
    )


def request_to_completions(
    request_output, prompt_index: int, n: int, eos_id: int | None, timings: dict[str, float] | None = None
) -> list[Completion]:
    """The ``n`` samples of one ``RequestOutput``, ordered by their ``index``."""
    outputs = sorted(request_output.outputs, key=lambda o: getattr(o, "index", 0))
    if len(outputs) != n:
        raise RuntimeError(f"vllm backend: asked for {n} samples of prompt {prompt_index}, got {len(outputs)}")
    return [to_completion(o, prompt_index, s, eos_id, timings) for s, o in enumerate(outputs)]


def copies(completion: Completion, n: int) -> list[Completion]:
    """``n`` copies of one greedy completion, numbered ``sample_index`` 0..n-1."""
    return [
        replace(
            completion,
            sample_index=s,
            token_ids=list(completion.token_ids),
            logprobs=list(completion.logprobs),
            timings=dict(completion.timings),
        )
        for s in range(n)
    ]


def forced_last_entry(request_output, last_token: int, row: int) -> dict:
    """The log-prob entry of the one generated token of a row sent without its last token (it must be that token)."""
    outputs = list(request_output.outputs)
    if len(outputs) != 1 or list(outputs[0].token_ids) != [last_token] or not outputs[0].logprobs:
        got = [list(o.token_ids) for o in outputs]
        raise RuntimeError(f"vllm backend: row {row}: the forced last token {last_token} was not generated (got {got})")
    return outputs[0].logprobs[0]


def engine_state(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Detached tensors with the floating ones in the engine's ``dtype`` (what its parameters hold)."""
    return {k: v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach() for k, v in state_dict.items()}


def probe_names(state: dict[str, torch.Tensor], worker_shapes: list[dict[str, list[int]]]) -> list[str]:
    """The parameters the load check hashes: among those every worker holds under the state dict's (HF) name with the
    full shape, i.e. neither fused (qkv_proj, gate_up_proj) nor sharded, ``CHECKED_TENSORS`` spread over the names."""
    same = [name for name, t in state.items() if all(shapes.get(name) == list(t.shape) for shapes in worker_shapes)]
    if not same:
        raise WeightSyncError(
            "vllm backend: cannot check weight updates: no parameter of the engine's model keeps the state dict's name and "
            f"shape (state names like {sorted(state)[:3]}, engine names like {sorted(worker_shapes[0])[:3] if worker_shapes else []})"
        )
    return checked_names(same)


def check_engine_load(before: list[str], after: list[str], expected: str, version: int) -> None:
    """Refuse a load unless every worker's hash of the checked parameters equals the sent weights' ``expected`` hash.

    A worker whose hash did not move is a stale load (the update was silently dropped); any other mismatch, a corrupt
    one. Equal ``before`` and ``expected`` (the same weights sent again) is a valid load.
    """
    if len(after) != len(before) or not after:
        raise WeightSyncError(f"vllm backend: weights version {version}: {len(before)} workers answered before the update, "
                              f"{len(after)} after")  # fmt: skip
    for rank, (was, now) in enumerate(zip(before, after)):
        if now == expected:
            continue
        stale = now == was
        kind = "its weights did not change (a stale load)" if stale else "they match neither the old nor the sent ones (a corrupt load)"
        raise WeightSyncError(
            f"vllm backend: engine worker {rank} did not take weights version {version}: {kind}; its checked parameters hash to "
            f"{now}, the sent weights to {expected}; refusing it"
        )


def ipc_update_info(state: dict[str, torch.Tensor], handles: list[dict[str, tuple]]) -> dict[str, Any]:
    """vLLM's ``IPCWeightTransferUpdateInfo`` fields (unpacked) for ``state`` and one handle dict per tensor."""
    return {
        "names": list(state),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
        "shapes": [list(t.shape) for t in state.values()],
        "ipc_handles": handles,
    }


def export_ipc(state: dict[str, torch.Tensor], devices: list[int]) -> tuple[list[torch.Tensor], list[dict[str, tuple]]]:
    """CUDA IPC handles of a copy of each tensor on each of ``devices``, keyed by the GPU's UUID (what vLLM's
    ``IPCWeightTransferEngine.receive_weights`` looks up), and the copies, which must stay alive until the update
    finishes. GPU only: not run on this project's machines."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuids = {d: str(torch.cuda.get_device_properties(d).uuid) for d in devices}
    keep: list[torch.Tensor] = []
    handles: list[dict[str, tuple]] = []
    for tensor in state.values():
        entry = {}
        for device in devices:
            copy = tensor.to(f"cuda:{device}").contiguous()
            keep.append(copy)
            entry[uuids[device]] = reduce_tensor(copy)[1]
        handles.append(entry)
    return keep, handles


# ---------------------------------------------------------------------------- the backend


class VLLMBackend:
    """Generates and scores with a ``vllm.LLM`` offline engine; see the module docstring."""

    presence_penalty = True  # SamplingParams.presence_penalty is applied (sent to the engine)

    score_fields = tuple(f for f in SCORE_FIELDS if f not in UNSUPPORTED_SCORE_FIELDS)  # what ``score`` can return

    def __init__(
        self,
        llm,
        tokenizer=None,
        *,
        max_logprobs: int | None = 20,
        show_progress: bool = False,
        tensor_parallel_size: int = 1,
        export: Callable[[dict[str, torch.Tensor], list[int]], tuple[list[torch.Tensor], list[dict[str, tuple]]]] | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer if tokenizer is not None else llm.get_tokenizer()
        try:
            self.tokenizer.padding_side = "left"
        except (AttributeError, ValueError):  # a tokenizer wrapper that does not take it
            pass
        self.eos_id = getattr(self.tokenizer, "eos_token_id", None)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else self.eos_id
        self.max_logprobs = max_logprobs
        self.show_progress = show_progress
        self.version = 0
        self.loaded_checksum: str | None = None  # the learner's checksum of the last verified load (check_loaded reads it)
        self.devices = list(range(int(tensor_parallel_size)))  # the engine's GPUs as this process numbers them
        self.export = export if export is not None else export_ipc  # the device boundary: state -> (copies, IPC handles)
        self._transfer_ready = False
        self._worker_shapes: list[dict[str, list[int]]] | None = None

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The engine's parameter dtype (``LLM.model_config.dtype``): weights are sent in it."""
        dtype = getattr(getattr(self.llm, "model_config", None), "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    @classmethod
    def load(
        cls,
        model: str,
        tensor_parallel_size: int | str = 1,
        gpu_memory_utilization: float | str = 0.5,
        dtype: str = "auto",
        max_model_len: int | str | None = None,
        seed: int | str = 0,
        enforce_eager: bool | str = False,
        max_logprobs: int | str = 20,
        enable_prefix_caching: bool | str | None = None,
        show_progress: bool | str = False,
        enable_thinking: bool | str | None = None,
        **engine_kwargs,
    ) -> "VLLMBackend":
        """Start a ``vllm.LLM`` on ``model`` (a local directory or hub id) with raw log-probs; ``enable_thinking`` is set
        in the engine tokenizer's chat template, with which the harness renders prompts."""
        mode = engine_kwargs.pop("logprobs_mode", RAW_LOGPROBS)
        if mode != RAW_LOGPROBS:
            raise ValueError(
                f"vllm backend: logprobs_mode must be {RAW_LOGPROBS!r} (log-probs of the untempered model distribution), got {mode!r}"
            )
        owned = [k for k in OWNED_ENGINE_OPTIONS if k in engine_kwargs]
        if owned:
            raise ValueError(f"vllm backend: {owned} are set by the backend (in-memory weight updates and their check); do not pass them")
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # CUDA IPC handles cross the engine core's msgpack
        kwargs: dict[str, Any] = dict(
            model=str(model),
            tensor_parallel_size=int(tensor_parallel_size),
            gpu_memory_utilization=float(gpu_memory_utilization),
            dtype=str(dtype),
            seed=int(seed),
            enforce_eager=as_bool(enforce_eager),
            max_logprobs=int(max_logprobs),
            logprobs_mode=RAW_LOGPROBS,
            weight_transfer_config=dict(WEIGHT_TRANSFER),
            worker_extension_cls=EXTENSION,
            **engine_kwargs,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = as_bool(enable_prefix_caching)
        llm = vllm.LLM(**kwargs)
        backend = cls(
            llm, max_logprobs=int(max_logprobs), show_progress=as_bool(show_progress), tensor_parallel_size=int(tensor_parallel_size)
        )
        if enable_thinking is not None:
            from opd_harness.models.hub import set_thinking

            set_thinking(backend.tokenizer, as_bool(enable_thinking))
        return backend

    # ------------------------------------------------------------------ vLLM objects

    @staticmethod
    def _tokens_prompt(token_ids: list[int]):
        try:
            from vllm.inputs import TokensPrompt
        except ImportError:  # a TypedDict: a plain dict is the same at run time
            return {"prompt_token_ids": list(token_ids)}
        return TokensPrompt(prompt_token_ids=list(token_ids))

    @staticmethod
    def _sampling_params(**kwargs):
        return import_vllm().SamplingParams(**kwargs)

    # ------------------------------------------------------------------ Backend protocol

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` samples per prompt, prompt-major, from one ``LLM.generate`` call."""
        check_sampling_params(params)
        if not prompts:
            return []
        started = time.perf_counter()
        requests = [self._tokens_prompt(p) for p in prompts]
        sampling = [self._sampling_params(**sampling_kwargs(params, i)) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=self.show_progress)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vllm backend: sent {len(prompts)} prompts, got {len(outputs)} outputs")
        timings = {"generate_s": (time.perf_counter() - started) / (len(prompts) * params.n)}
        sent_n = 1 if params.greedy else params.n
        completions: list[Completion] = []
        for prompt_index, request_output in enumerate(outputs):
            samples = request_to_completions(request_output, prompt_index, sent_n, self.eos_id, timings)
            completions.extend(samples if sent_n == params.n else copies(samples[0], params.n))
        return completions

    def max_model_len(self) -> int | None:
        """The engine's context length (``LLM.model_config.max_model_len``), None when it cannot be read."""
        value = getattr(getattr(self.llm, "model_config", None), "max_model_len", None)
        return int(value) if value is not None else None

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        want: tuple[str, ...] = ("logprobs",),
        top_k: int = 0,
        grad: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Per-position ``logprobs`` (and ``topk_logprobs``/``topk_ids``) aligned with ``input_ids``.

        Position 0 of each sequence and padding positions are 0. ``entropy``/``full`` raise
        ``NotImplementedError``; ``grad=True`` is refused (an inference engine has no autograd).
        A row of exactly ``max_model_len`` tokens is scored as described in the module docstring.
        """
        if grad:
            raise NotImplementedError("the vllm backend cannot score with gradients; use the hf backend for a trained model")
        check_score_request(want, top_k, self.max_logprobs)
        rows = unpadded_sequences(input_ids, attention_mask)
        limit = self.max_model_len()
        check_row_lengths([len(tokens) for _, tokens in rows], limit)
        live = [b for b, (_, tokens) in enumerate(rows) if tokens]
        per_row: list = [None] * len(rows)
        if live:
            full_rows = {b for b in live if limit is not None and len(rows[b][1]) == limit}
            prompts, sampling = [], []
            for b in live:
                tokens = rows[b][1]
                if b in full_rows:
                    prompts.append(self._tokens_prompt(tokens[:-1]))
                    sampling.append(self._sampling_params(**last_token_kwargs(want, top_k, tokens[-1])))
                else:
                    prompts.append(self._tokens_prompt(tokens))
                    sampling.append(self._sampling_params(**score_sampling_kwargs(want, top_k)))
            outputs = self.llm.generate(prompts, sampling, use_tqdm=self.show_progress)
            if len(outputs) != len(live):
                raise RuntimeError(f"vllm backend: sent {len(live)} rows to score, got {len(outputs)} outputs")
            for b, request_output in zip(live, outputs):
                entries = request_output.prompt_logprobs
                if b in full_rows:
                    entries = list(entries or []) + [forced_last_entry(request_output, rows[b][1][-1], b)]
                per_row[b] = entries
        scores = prompt_logprobs_to_tensor(per_row, input_ids.cpu(), attention_mask.cpu(), want, top_k)
        return {k: v.to(input_ids.device) for k, v in scores.items()}

    def close(self) -> None:
        """Best effort: stop the engine's background process now instead of at garbage collection."""
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Update every worker's weights in memory from ``state_dict`` (HF names), check what they hold, then record ``version``.

        See the module docstring: vLLM's IPC weight transfer, then every worker's hash of a few parameters against the
        sent weights' (:func:`check_engine_load`); a stale or corrupt load raises ``WeightSyncError`` and nothing is bumped.
        """
        dtype = self.param_dtype
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
        state = engine_state(state_dict, dtype)
        probe = probe_names(state, self.worker_shapes())
        expected = checksum({name: state[name] for name in probe}, dtype)
        before = self.llm.collective_rpc("harness_checksum", args=(probe, dtype_name))
        self._transfer(state, version)
        after = self.llm.collective_rpc("harness_checksum", args=(probe, dtype_name))
        check_engine_load(list(before), list(after), expected, version)
        if not self.llm.reset_prefix_cache():  # cached KV blocks were computed with the old weights
            raise RuntimeError("vllm backend: reset_prefix_cache() failed after a weight update (requests still running?)")
        self.version = version
        self.loaded_checksum = checksum(state_dict)

    def worker_shapes(self) -> list[dict[str, list[int]]]:
        """Each worker's parameter names and shapes (asked once: a model's layout does not change)."""
        if self._worker_shapes is None:
            self._worker_shapes = list(self.llm.collective_rpc("harness_param_shapes"))
        return self._worker_shapes

    def _transfer(self, state: dict[str, torch.Tensor], version: int) -> None:
        """One update session of vLLM's IPC weight transfer: start, the whole state in one chunk, finish."""
        if not self._transfer_ready:
            self.llm.init_weight_transfer_engine({"init_info": {"packed": False}})
            self._transfer_ready = True
        keep, handles = self.export(state, self.devices)
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": ipc_update_info(state, handles)})
            self.llm.finish_weight_update(weight_version=str(version))
        finally:
            del keep  # the copies outlive the update (the workers read them through the handles), then go
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()
