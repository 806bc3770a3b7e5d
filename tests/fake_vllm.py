"""A stand-in for the parts of vLLM 0.33.0 that ``harness/backends/vllm_backend.py`` calls, strict where vLLM is.

Each rule below cites the vLLM source it copies, so a CPU test fails where the real engine would:

* ``SamplingParams`` validates as ``vllm/sampling_params.py`` does (``_verify_args``,
  ``_verify_greedy_sampling``, the ``_MAX_TEMP`` clamp, ``allowed_token_ids`` not empty).
* ``LLM.generate`` refuses an empty prompt, one longer than ``max_model_len`` and, for a generating
  model, one of exactly ``max_model_len`` tokens (``v1/engine/input_processor.py``,
  ``_validate_prompt_len``), and ``logprobs``/``prompt_logprobs`` above ``max_logprobs``.
* ``LLM.collective_rpc`` sends ``(method, timeout, args, kwargs)`` through msgpack the way the
  frontend's ``MsgpackEncoder`` does (a tensor becomes ``(dtype, shape, raw bytes)``; any other
  non-msgpack object is a ``TypeError`` without ``VLLM_ALLOW_INSECURE_SERIALIZATION``) and decodes
  it untyped, as the engine core decodes UTILITY requests (``v1/serial_utils.py``,
  ``v1/engine/core.py``): a tensor argument reaches the worker as a list. The worker then runs the
  named method: one of vLLM's ``Worker`` or of ``worker_extension_cls`` (mixed in as vLLM does).
* The weight-transfer calls (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
  ``finish_weight_update``; ``vllm/entrypoints/rl/offline.py``) keep the worker's session rules
  (``v1/worker/gpu_worker.py``: no transfer without ``weight_transfer_config``; update only inside a started
  session; finish only after a start) and validate the IPC update info like ``IPCWeightTransferUpdateInfo``
  (``distributed/weight_transfer/ipc_engine.py``). CUDA IPC is replaced at the device boundary by
  :func:`fake_export`: a handle names a tensor in this process's :data:`SHARED` table. ``fault`` makes the
  worker drop an update silently ("stale") or load garbage ("corrupt"), the failures the backend must catch.
* ``reset_prefix_cache`` returns a bool, as ``LLM.reset_prefix_cache`` does.
"""

from __future__ import annotations

import importlib
import types
from types import SimpleNamespace

import msgpack
import torch

CUSTOM_TYPE_RAW_VIEW = 3  # vllm.v1.serial_utils
SAMPLING_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS
MAX_TEMP_CLAMP = 1e-2  # vllm.sampling_params._MAX_TEMP
EOS = 1


class VLLMValidationError(Exception):
    """vLLM 0.33's ``VLLMValidationError`` is a ``VLLMClientError``, not a ``ValueError`` (``vllm/exceptions.py``)."""


def lp(value: float, rank: int | None = None):
    """Like ``vllm.logprobs.Logprob``."""
    return SimpleNamespace(logprob=value, rank=rank, decoded_token=None)


class FakeSamplingParams(dict):
    """``vllm.SamplingParams(**kwargs)``: a dict of the arguments, validated and normalised like vLLM's."""

    def __init__(self, **kwargs):
        params = {"n": 1, "temperature": 1.0, "top_p": 1.0, "stop": [], "detokenize": True, "logprobs": None, "prompt_logprobs": None}
        params.update(kwargs)
        if isinstance(params["stop"], str):
            params["stop"] = [params["stop"]]
        super().__init__(params)
        n, temperature = params["n"], params["temperature"]
        if not isinstance(n, int) or n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {n}.")
        if temperature < 0.0:
            raise VLLMValidationError(f"temperature must be non-negative, got {temperature}.")
        if temperature > 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {temperature}.")
        if not 0.0 < params["top_p"] <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {params['top_p']}.")
        if params.get("max_tokens") is not None and params["max_tokens"] < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {params['max_tokens']}.")
        if any(not stop for stop in params["stop"]):
            raise VLLMValidationError("stop cannot contain an empty string.")
        if params["stop"] and not params["detokenize"]:
            raise VLLMValidationError("stop strings are only supported when detokenize is True.")
        if "allowed_token_ids" in params and not params["allowed_token_ids"]:
            raise VLLMValidationError("allowed_token_ids is not None and empty!")
        if 0 < temperature < MAX_TEMP_CLAMP:
            self["temperature"] = MAX_TEMP_CLAMP  # vLLM warns and raises it
        if self["temperature"] < SAMPLING_EPS:
            self["top_p"] = 1.0
            if n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {n}.")


# ---------------------------------------------------------------------------- the RPC serialisation boundary


def _encode_hook(obj):
    """``MsgpackEncoder.enc_hook`` without insecure serialisation: tensors inline, anything else refused."""
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return [str(obj.dtype).removeprefix("torch."), list(obj.shape), msgpack.ExtType(CUSTOM_TYPE_RAW_VIEW, raw)]
    raise TypeError(
        f"Object of type {type(obj)} is not serializable. "
        "Set VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based serialization."
    )


def _decode_ext(code: int, data: bytes):
    if code == CUSTOM_TYPE_RAW_VIEW:
        return memoryview(data)
    raise TypeError(f"unexpected msgpack extension {code}")


def utility_round_trip(payload):
    """What the engine core receives for a UTILITY call: encoded by the frontend, decoded untyped."""
    return msgpack.unpackb(msgpack.packb(payload, default=_encode_hook), ext_hook=_decode_ext, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------------- the worker side


SHARED: dict[int, torch.Tensor] = {}  # stands in for GPU memory shared through CUDA IPC handles
FAKE_GPU = "fake-gpu-{}"  # a device's UUID, as torch.cuda.get_device_properties(d).uuid names it
IPC_FIELDS = ("names", "dtype_names", "shapes", "ipc_handles")  # IPCWeightTransferUpdateInfo's fields this backend sends


def fake_export(state: dict[str, torch.Tensor], devices: list[int]) -> tuple[list[torch.Tensor], list[dict[str, tuple]]]:
    """``export_ipc`` on a CPU: each tensor copied once per device into :data:`SHARED`; a handle is its key there."""
    keep, handles = [], []
    for tensor in state.values():
        entry = {}
        for device in devices:
            copy = tensor.detach().clone()
            keep.append(copy)
            SHARED[id(copy)] = copy
            entry[FAKE_GPU.format(device)] = (id(copy),)
        handles.append(entry)
    return keep, handles


class FakeModel:
    """A vLLM model: parameters under vLLM's names (q/k/v fused into ``qkv_proj``, like ``QKVParallelLinear``) and
    ``load_weights(weights)`` taking (HF name, tensor) pairs; an unknown name is a ``KeyError``, as in vLLM's loaders."""

    PACKED = {"q_proj": 0, "k_proj": 1, "v_proj": 2}  # stacked params_mapping: shard index in qkv_proj

    def __init__(self, hidden: int = 4, vocab: int = 8):
        g = torch.Generator().manual_seed(0)
        self.params = {
            "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
            "model.layers.0.input_layernorm.weight": torch.randn(hidden, generator=g),
            "model.layers.0.self_attn.qkv_proj.weight": torch.randn(3 * hidden, hidden, generator=g),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, hidden, generator=g),
            "model.norm.weight": torch.randn(hidden, generator=g),
        }
        self.hidden = hidden

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"load_weights: {name} is a {type(tensor).__name__}, not a tensor")
            prefix, _, leaf = name.rpartition(".")
            module, _, proj = prefix.rpartition(".")
            if proj in self.PACKED:
                rows = slice(self.PACKED[proj] * self.hidden, (self.PACKED[proj] + 1) * self.hidden)
                self.params[f"{module}.qkv_proj.{leaf}"][rows].copy_(tensor)
            elif name == "lm_head.weight":  # tied to the embeddings: vLLM skips it
                continue
            else:
                self.params[name].copy_(tensor)
            loaded.add(name)
        return loaded


def hf_state(model: FakeModel) -> dict[str, torch.Tensor]:
    """The HF-named state dict that holds exactly ``model``'s weights (q/k/v split, lm_head tied)."""
    state = {k: v.clone() for k, v in model.params.items() if ".qkv_proj." not in k}
    qkv = model.params["model.layers.0.self_attn.qkv_proj.weight"]
    for proj, index in FakeModel.PACKED.items():
        state[f"model.layers.0.self_attn.{proj}.weight"] = qkv[index * model.hidden : (index + 1) * model.hidden].clone()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return state


class FakeWorker:
    """``vllm.v1.worker.gpu_worker.Worker``: ``get_model`` and the weight-transfer session of an "ipc" engine."""

    def __init__(self, rank: int = 0, model=None, transfer: bool = True, fault=None):
        self.rank, self.model, self.fault = rank, model if model is not None else FakeModel(), fault
        self.transfer = transfer  # weight_transfer_config was given
        self.active = False
        self.packed = None
        self.updates = 0

    def get_model(self):
        return self.model

    def _check_weight_transfer_engine(self):
        if not self.transfer:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable weight transfer.")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._check_weight_transfer_engine()
        unknown = set(init_info) - {"packed"}
        if unknown:
            raise TypeError(f"IPCWeightTransferInitInfo.__init__() got unexpected keyword arguments {sorted(unknown)}")
        self.packed = bool(init_info.get("packed", False))

    def start_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active. Call finish_weight_update first.")
        self.active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_weight_transfer_engine()
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if set(update_info) != set(IPC_FIELDS) or self.packed is not False:
            raise TypeError(f"unexpected IPC update info fields {sorted(update_info)} (packed={self.packed})")
        names = update_info["names"]
        if not all(len(update_info[k]) == len(names) for k in IPC_FIELDS):
            raise ValueError("`dtype_names`, `shapes` and `ipc_handles` should be of the same size as `names`")
        weights = []
        for name, dtype, shape, handle in zip(*(update_info[k] for k in IPC_FIELDS)):
            uuid = FAKE_GPU.format(self.rank)
            if uuid not in handle:
                raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(handle)}")
            tensor = SHARED[handle[uuid][0]]
            assert str(tensor.dtype).removeprefix("torch.") == dtype and list(tensor.shape) == list(shape)
            weights.append((name, torch.zeros_like(tensor) if self.fault == "corrupt" else tensor))
        if self.fault != "stale":  # "stale": the update is dropped without a word, as in the reports the check is for
            load_into(self.model, weights)
        self.updates += 1

    def finish_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.active = False


def load_into(model, weights) -> None:
    """The model's own ``load_weights`` (vLLM's models have one); an HF model takes its state dict."""
    if hasattr(model, "load_weights"):
        model.load_weights(weights)
    else:
        with torch.no_grad():
            model.load_state_dict(dict(weights), strict=True)


def make_worker(extension: str | None, rank: int = 0, model=None, transfer: bool = True) -> FakeWorker:
    """A worker with the extension class mixed in, as vLLM does with ``worker_extension_cls``."""
    if not extension:
        return FakeWorker(rank, model, transfer)
    module, _, name = extension.rpartition(".")
    mixin = getattr(importlib.import_module(module), name)
    return type("WorkerWithExtension", (FakeWorker, mixin), {})(rank, model, transfer)


# ---------------------------------------------------------------------------- the engine


class FakeTokenizer:
    eos_token_id = EOS
    pad_token_id = 0
    padding_side = "right"


def completion_output(token_ids, logprobs=None, finish="stop", index=0, text="", with_logprobs=True):
    """Like ``vllm.outputs.CompletionOutput``: ``logprobs`` is one {token_id: Logprob} dict per token."""
    if with_logprobs and logprobs is None:
        logprobs = [-0.1 * (i + 1) for i in range(len(token_ids))]
    entries = [{t: lp(v, 1), 99: lp(v - 5.0, 2)} for t, v in zip(token_ids, logprobs)] if with_logprobs else None
    return SimpleNamespace(index=index, token_ids=list(token_ids), logprobs=entries, text=text, finish_reason=finish, stop_reason=None)


def score_entry(token: int, k: int) -> dict:
    """A position's log-prob dict: the actual token at -token/10, plus k more likely ids 100.."""
    return {token: lp(-token / 10, 50), **{100 + j: lp(-0.01 * (j + 1), j + 1) for j in range(k)}}


class FakeLLM:
    """``vllm.LLM``: records calls; samples deterministically; scores token t at -t/10."""

    def __init__(self, max_model_len: int = 64, max_logprobs: int = 20, **kwargs):
        self.kwargs = {"max_model_len": max_model_len, "max_logprobs": max_logprobs, **kwargs}
        self.model_config = SimpleNamespace(max_model_len=max_model_len, runner_type="generate", dtype=torch.float32)
        self.max_logprobs = max_logprobs
        self.calls = []
        self.rpc = []
        self.prefix_resets = 0
        self.prefix_reset_result = True
        self.weight_version = None
        transfer = kwargs.get("weight_transfer_config") is not None
        extension = kwargs.get("worker_extension_cls")
        self.workers = [make_worker(extension, rank, transfer=transfer) for rank in range(int(kwargs.get("tensor_parallel_size", 1)))]
        self.worker = self.workers[0]

    def get_tokenizer(self):
        return FakeTokenizer()

    def _validate(self, ids: list[int], sp: FakeSamplingParams) -> None:
        limit = self.model_config.max_model_len
        if not ids:
            raise VLLMValidationError("The decoder prompt cannot be empty")
        if len(ids) > limit:
            raise VLLMValidationError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of {limit}.")
        if len(ids) == limit:
            raise VLLMValidationError(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {limit}."
            )
        for key in ("logprobs", "prompt_logprobs"):
            if sp.get(key) is not None and sp[key] > self.max_logprobs:
                raise VLLMValidationError(f"Requested {key} of {sp[key]}, which is greater than max allowed: {self.max_logprobs}")

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None, tokenization_kwargs=None,
                 mm_processor_kwargs=None):  # fmt: skip
        self.calls.append((prompts, sampling_params))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        for prompt, sp in zip(prompts, params):
            self._validate(prompt["prompt_token_ids"], sp)
        outputs = []
        for prompt, sp in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            if sp.get("prompt_logprobs") is not None:  # scoring: log-prob of token t is -t/10
                k = sp["prompt_logprobs"]
                entries = [None] + [score_entry(tok, k) for tok in ids[1:]]
                forced = sp.get("allowed_token_ids")
                token = forced[0] if forced else 5
                sampled = [score_entry(token, sp["logprobs"] or 0)] if sp.get("logprobs") is not None else None
                out = SimpleNamespace(index=0, token_ids=[token], logprobs=sampled, text="", finish_reason="length", stop_reason=None)
                outputs.append(SimpleNamespace(prompt_logprobs=entries, outputs=[out]))
                continue
            # sampling: n outputs, returned in reverse index order to check the sorting
            samples = [completion_output([ids[-1] + s, EOS], finish="stop", index=s, text=f"s{s}") for s in range(sp["n"])]
            outputs.append(SimpleNamespace(prompt_logprobs=None, outputs=samples[::-1]))
        return outputs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        method, timeout, args, kwargs = utility_round_trip([method, timeout, list(args), kwargs or {}])
        self.rpc.append((method, args, kwargs))
        return [getattr(worker, method)(*args, **kwargs) for worker in self.workers]

    # vllm/entrypoints/rl/offline.py (RLOfflineMixin): each is a collective_rpc of the worker method of the same name.
    # The IPC handles need VLLM_ALLOW_INSECURE_SERIALIZATION (pickled), so they skip the msgpack round trip here.

    def init_weight_transfer_engine(self, request) -> None:
        self.rpc.append(("init_weight_transfer_engine", [], {"init_info": request["init_info"]}))
        for worker in self.workers:
            worker.init_weight_transfer_engine(request["init_info"])

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, request) -> None:
        self.rpc.append(("update_weights", [], {"update_info": request["update_info"]}))
        for worker in self.workers:
            worker.update_weights(request["update_info"])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        self.prefix_resets += 1
        return self.prefix_reset_result


def fake_vllm_module(llm_factory=None):
    """A stand-in ``vllm`` module: strict ``SamplingParams``; ``LLM`` is ``llm_factory``."""
    module = types.ModuleType("vllm")
    module.SamplingParams = FakeSamplingParams
    module.LLM = llm_factory
    return module


# ---------------------------------------------------------------------------- an engine over a real model, off the trainer's numbers

ENGINE_LOGPROB_SCALE = 1.1  # the engine reports 1.1 × the trainer's log-probs: another precision or kernel, a known mismatch


class HFEngineLLM(FakeLLM):
    """``vllm.LLM(model=folder)`` that samples and scores with the folder's HF model (so a training run can use it as its
    rollout engine on CPU), but reports every log-prob ``ENGINE_LOGPROB_SCALE`` times the model's, as a real engine's
    differ from the trainer's. Its context is the model's positions; ``prompt_logprobs`` > 0 (top-k) is not supported."""

    def __init__(self, model: str, max_logprobs: int = 20, **kwargs):
        from opd_harness.backends.hf import HFBackend

        self.hf = HFBackend.load(model)
        super().__init__(max_model_len=self.hf.max_context, max_logprobs=max_logprobs, model=model, **kwargs)
        self.workers = [make_worker(kwargs.get("worker_extension_cls"), 0, self.hf.model, kwargs.get("weight_transfer_config") is not None)]
        self.worker = self.workers[0]

    def get_tokenizer(self):
        return self.hf.tokenizer

    def _scored(self, ids: list[int]) -> list[float]:
        tensor = torch.tensor([ids])
        return (self.hf.score(tensor, torch.ones_like(tensor))["logprobs"][0] * ENGINE_LOGPROB_SCALE).tolist()

    def _score_output(self, ids: list[int], sp: FakeSamplingParams):
        if sp["prompt_logprobs"]:
            raise NotImplementedError("HFEngineLLM scores the actual tokens only (prompt_logprobs=0)")
        values = self._scored(ids)
        entries = [None] + [{tok: lp(v, 1)} for tok, v in zip(ids[1:], values[1:])]
        forced = sp.get("allowed_token_ids")
        token = forced[0] if forced else ids[-1]
        sampled = [{token: lp(self._scored(ids + [token])[-1], 1)}] if sp.get("logprobs") is not None else None
        out = SimpleNamespace(index=0, token_ids=[token], logprobs=sampled, text="", finish_reason="length")
        return SimpleNamespace(prompt_logprobs=entries, outputs=[out])

    def _sample_output(self, ids: list[int], sp: FakeSamplingParams):
        from opd_harness.backends import SamplingParams

        params = SamplingParams(
            temperature=sp["temperature"], top_p=sp["top_p"], max_new_tokens=sp["max_tokens"], n=sp["n"], seed=sp.get("seed"),
            stop=tuple(sp["stop"]),
        )  # fmt: skip
        samples = [
            completion_output(c.token_ids, [v * ENGINE_LOGPROB_SCALE for v in c.logprobs], finish=c.finish_reason, index=i, text=c.text)
            for i, c in enumerate(self.hf.generate([ids], params))
        ]
        return SimpleNamespace(prompt_logprobs=None, outputs=samples)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None, tokenization_kwargs=None,
                 mm_processor_kwargs=None):  # fmt: skip
        self.calls.append((prompts, sampling_params))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        for prompt, sp in zip(prompts, params, strict=True):
            self._validate(prompt["prompt_token_ids"], sp)
        handlers = [self._score_output if sp.get("prompt_logprobs") is not None else self._sample_output for sp in params]
        return [handle(p["prompt_token_ids"], sp) for handle, p, sp in zip(handlers, prompts, params)]
