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
  named method: vLLM's ``Worker.reload_weights`` (reads ``*.safetensors`` from ``weights_path``
  like ``DefaultModelLoader``) or a method of ``worker_extension_cls``.
* ``reset_prefix_cache`` returns a bool, as ``LLM.reset_prefix_cache`` does.
"""

from __future__ import annotations

import importlib
import types
from pathlib import Path
from types import SimpleNamespace

import msgpack
import torch

CUSTOM_TYPE_RAW_VIEW = 3  # vllm.v1.serial_utils
SAMPLING_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS
MAX_TEMP_CLAMP = 1e-2  # vllm.sampling_params._MAX_TEMP
EOS = 1


class VLLMValidationError(ValueError):
    """vLLM's ``VLLMValidationError`` is a ``ValueError``."""


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


class FakeModel(torch.nn.Module):
    """A model with vLLM's ``load_weights(weights)`` (an iterable of (name, tensor); returns the loaded names)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        names = set()
        for name, tensor in weights:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"load_weights: {name} is a {type(tensor).__name__}, not a tensor")
            self.loaded[name] = tensor.clone()
            names.add(name)
        return names


class FakeModelRunner:
    def __init__(self):
        self.model = FakeModel()
        self.reloads = 0

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        """``GPUModelRunner.reload_weights``: from an iterator, or every ``*.safetensors`` file in ``weights_path``."""
        from safetensors.torch import load_file

        if weights_iterator is None:
            files = sorted(Path(weights_path).glob("*.safetensors"))
            if not files:
                raise RuntimeError(f"Cannot find any model weights with `{weights_path}`")
            weights_iterator = [item for f in files for item in load_file(str(f)).items()]
        self.model.load_weights(weights_iterator)
        self.reloads += 1


class FakeWorker:
    """``vllm.v1.worker.gpu_worker.Worker``: its ``reload_weights`` plus any ``worker_extension_cls`` methods."""

    def __init__(self):
        self.model_runner = FakeModelRunner()

    def reload_weights(self, *args, **kwargs):
        self.model_runner.reload_weights(*args, **kwargs)


def make_worker(extension: str | None) -> FakeWorker:
    """A worker with the extension class mixed in, as vLLM does with ``worker_extension_cls``."""
    if not extension:
        return FakeWorker()
    module, _, name = extension.rpartition(".")
    mixin = getattr(importlib.import_module(module), name)
    return type("WorkerWithExtension", (FakeWorker, mixin), {})()


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
        self.model_config = SimpleNamespace(max_model_len=max_model_len, runner_type="generate")
        self.max_logprobs = max_logprobs
        self.calls = []
        self.rpc = []
        self.prefix_resets = 0
        self.prefix_reset_result = True
        self.worker = make_worker(kwargs.get("worker_extension_cls"))

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

    def generate(self, prompts, sampling_params, use_tqdm=True):
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
        return [getattr(self.worker, method)(*args, **kwargs)]

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


class HFWorker:
    """The worker of :class:`HFEngineLLM`: vLLM's ``reload_weights(weights_path=...)`` into the HF model."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.reloads = 0

    def reload_weights(self, weights_path=None, **_):
        from safetensors.torch import load_file

        files = sorted(Path(weights_path).glob("*.safetensors"))
        if not files:
            raise RuntimeError(f"Cannot find any model weights with `{weights_path}`")
        self.model.load_state_dict({k: v for f in files for k, v in load_file(str(f)).items()})
        self.reloads += 1


class HFEngineLLM(FakeLLM):
    """``vllm.LLM(model=folder)`` that samples and scores with the folder's HF model (so a training run can use it as its
    rollout engine on CPU), but reports every log-prob ``ENGINE_LOGPROB_SCALE`` times the model's, as a real engine's
    differ from the trainer's. Its context is the model's positions; ``prompt_logprobs`` > 0 (top-k) is not supported."""

    def __init__(self, model: str, max_logprobs: int = 20, **kwargs):
        from opd_harness.backends.hf import HFBackend

        self.hf = HFBackend.load(model)
        super().__init__(max_model_len=self.hf.max_context, max_logprobs=max_logprobs, model=model, **kwargs)
        self.worker = HFWorker(self.hf.model)

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

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        for prompt, sp in zip(prompts, params, strict=True):
            self._validate(prompt["prompt_token_ids"], sp)
        handlers = [self._score_output if sp.get("prompt_logprobs") is not None else self._sample_output for sp in params]
        return [handle(p["prompt_token_ids"], sp) for handle, p, sp in zip(handlers, prompts, params)]
