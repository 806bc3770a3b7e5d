"""API conformance: every vLLM class, method, argument and field the vllm backend uses exists, with that signature, in
the installed vLLM (0.33.0), so a rename upstream fails CI instead of a user's run.

The calls are read from the backend's source where they can be (``ast``): every ``llm.X(...)`` call with its arguments,
every worker method named in ``collective_rpc``, every attribute read through ``getattr(..., "name")``; a call the
backend starts making is checked without editing this file. The rest runs the backend's own helpers on real vLLM
objects: ``SamplingParams`` built from the keyword arguments the backend sends, ``RequestOutput``/``CompletionOutput``
with log-probs built by vLLM's own builders, the IPC weight-transfer request types. The stand-in engine of the CPU
tests (``tests/fake_vllm.py``) is held to the same signatures.

vLLM is CUDA-only and pins torch 2.14 / transformers < 5.21, so it lives in its own environment (``.ci/legs/vllm.sh``).
Without it these tests skip; with ``HARNESS_REQUIRE_VLLM=1`` (that CI leg) they fail instead.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import tomllib
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BACKEND_SOURCE = ROOT / "harness" / "backends" / "vllm_backend.py"
VLLM_VERSION = "0.33.0"  # the version the gpu extra pins and this file checks
REQUIRE_VLLM = os.environ.get("HARNESS_REQUIRE_VLLM") == "1"


def _vllm():
    """The installed vllm, or a skip (a failure under ``HARNESS_REQUIRE_VLLM=1``)."""
    if importlib.util.find_spec("vllm") is None:
        reason = "vllm is not installed (it has its own environment: .ci/legs/vllm.sh)"
        if REQUIRE_VLLM:
            pytest.fail(f"HARNESS_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return importlib.import_module("vllm")


def compact(source: str) -> str:
    """Source without whitespace, so a reformatting upstream does not fail a check of what the code does."""
    return "".join(source.split())


@pytest.fixture(scope="module")
def vllm():
    return _vllm()


# ---------------------------------------------------------------------------- what the backend's source calls


def _is_llm(node: ast.expr) -> bool:
    """``self.llm`` or ``llm``: the engine object."""
    return (isinstance(node, ast.Attribute) and node.attr == "llm") or (isinstance(node, ast.Name) and node.id == "llm")


def llm_calls(tree: ast.AST) -> dict[str, list[tuple[int, tuple[str, ...]]]]:
    """Every ``llm.NAME(...)`` call of the source: NAME -> [(positional argument count, keyword names)]."""
    calls: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_llm(node.func.value):
            keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
            calls.setdefault(node.func.attr, []).append((len(node.args), keywords))
    return calls


def rpc_methods(tree: ast.AST) -> set[str]:
    """The worker methods named (as a string literal first argument) in ``collective_rpc`` calls."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "collective_rpc":
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "method"), None)
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), f"line {node.lineno}: a worker method by name"
            names.add(first.value)
    return names


def getattr_names(tree: ast.AST) -> set[str]:
    """Attribute names the source reads with ``getattr(obj, "name", ...)``."""
    return {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
    }  # fmt: skip


def imported_vllm_names(tree: ast.AST) -> set[tuple[str, str]]:
    """``from vllm.x import Y`` statements of the source: (module, name)."""
    return {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm"
        for alias in node.names
    }


@pytest.fixture(scope="module")
def tree() -> ast.AST:
    return ast.parse(BACKEND_SOURCE.read_text())


def test_the_source_scan_finds_the_calls_it_must(tree):
    """The scanners above are not vacuous: they see the calls the module docstring describes."""
    calls = llm_calls(tree)
    for name in ("generate", "collective_rpc", "reset_prefix_cache", "start_weight_update", "update_weights", "finish_weight_update"):
        assert name in calls, name
    assert rpc_methods(tree) == {"harness_param_shapes", "harness_checksum"}
    assert {"model_config", "llm_engine", "engine_core"} <= getattr_names(tree)
    assert ("vllm.inputs", "TokensPrompt") in imported_vllm_names(tree)


# ---------------------------------------------------------------------------- version and engine construction


def test_the_installed_vllm_is_the_pinned_one(vllm):
    assert vllm.__version__ == VLLM_VERSION
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(r).specifier for r in extras["vllm"] if Requirement(r).name == "vllm"]
    assert VLLM_VERSION in spec  # the extra users install admits the version this file checks the backend against


def _sent_engine_kwargs(vllm, monkeypatch, model: str, **options) -> dict:
    """The keyword arguments ``VLLMBackend.load`` gives ``vllm.LLM`` (captured; no engine is started)."""
    from opd_harness.backends.vllm_backend import VLLMBackend

    sent = {}

    class Captured(Exception):
        pass

    def capture(**kwargs):
        sent.update(kwargs)
        raise Captured

    monkeypatch.setattr(vllm, "LLM", capture)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(Captured):
        VLLMBackend.load(model, **options)
    return sent


def test_every_engine_argument_the_backend_passes_is_accepted_by_llm_and_engine_args(vllm, monkeypatch, tmp_path):
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import EngineArgs

    real_llm = vllm.LLM
    sent = _sent_engine_kwargs(vllm, monkeypatch, str(tmp_path), max_model_len=256, enable_prefix_caching="true")  # a local folder
    llm_params = inspect.signature(real_llm.__init__).parameters
    engine_fields = {f.name for f in fields(EngineArgs)}
    unknown = [k for k in sent if k not in llm_params and k not in engine_fields]
    assert not unknown, f"vllm.LLM takes neither as a parameter nor as an EngineArgs field: {unknown}"
    assert sent["logprobs_mode"] in typing.get_args(LogprobsMode)
    args = EngineArgs(**sent)  # the values are of the types vLLM's engine arguments take
    assert args.weight_transfer_config.backend == "ipc" and args.worker_extension_cls == sent["worker_extension_cls"]
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_the_weight_transfer_backend_and_worker_extension_resolve(vllm):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from opd_harness.backends.vllm_backend import WEIGHT_TRANSFER
    from opd_harness.backends.vllm_worker import EXTENSION, WeightCheck

    assert WEIGHT_TRANSFER["backend"] in WeightTransferEngineFactory._registry
    assert resolve_obj_by_qualname(EXTENSION) is WeightCheck


# ---------------------------------------------------------------------------- LLM methods and the stand-in engine


def _bind(signature: inspect.Signature, positional: int, keywords: tuple[str, ...]) -> None:
    """Bind dummy arguments as the backend passes them (after ``self``); a missing or renamed parameter raises."""
    signature.bind(object(), *([object()] * positional), **{k: object() for k in keywords})


def test_every_llm_method_the_backend_calls_exists_and_takes_its_arguments(vllm, tree):
    for method, uses in sorted(llm_calls(tree).items()):
        real = getattr(vllm.LLM, method, None)
        assert callable(real), f"vllm.LLM has no method {method}"
        for positional, keywords in uses:
            _bind(inspect.signature(real), positional, keywords)


def test_the_stand_in_engine_has_the_real_signatures(vllm, tree):
    """tests/fake_vllm.py's FakeLLM takes exactly the parameters vllm.LLM's methods take, for every method the backend calls."""
    from fake_vllm import FakeLLM

    for method in sorted(llm_calls(tree)):
        real = [(p.name, p.kind) for p in inspect.signature(getattr(vllm.LLM, method)).parameters.values()]
        fake = [(p.name, p.kind) for p in inspect.signature(getattr(FakeLLM, method)).parameters.values()]
        assert fake == real, f"FakeLLM.{method}{fake} != vllm.LLM.{method}{real}"


def test_the_stand_in_worker_has_the_real_worker_methods(vllm):
    """The methods the weight-transfer calls reach on each worker (vllm/entrypoints/rl/offline.py) exist on vLLM's
    ``Worker`` with the stand-in worker's parameters, and the worker extension's methods clash with none of Worker's
    (vLLM refuses such an extension)."""
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    from fake_vllm import FakeWorker

    from opd_harness.backends.vllm_worker import WeightCheck

    offline = compact(inspect.getsource(importlib.import_module("vllm.entrypoints.rl.offline")))
    for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update", "get_model"):
        real = list(inspect.signature(getattr(gpu_worker.Worker, method)).parameters)
        assert list(inspect.signature(getattr(FakeWorker, method)).parameters) == real, method
        assert method == "get_model" or f'collective_rpc("{method}"' in offline
    assert not [a for a in dir(WeightCheck) if not a.startswith("__") and hasattr(gpu_worker.Worker, a)]


def test_every_collective_rpc_method_is_one_the_worker_extension_defines(tree):
    from opd_harness.backends.vllm_worker import WeightCheck

    for method in rpc_methods(tree):
        assert callable(getattr(WeightCheck, method, None)), method


# ---------------------------------------------------------------------------- attributes read through getattr

# Each name the backend reads with getattr -> where it lives (a vLLM class and how to see it there), or None: not vLLM's
# (the tokenizer's, or one of our own objects). A new getattr in the backend fails here until it is placed.
NOT_VLLM = {"eos_token_id", "pad_token_id", "padding_side", "param_dtype"}


def _owner_has(vllm, name: str) -> bool:
    from vllm.config.model import ModelConfig
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine

    init_sources = {
        "model_config": inspect.getsource(vllm.LLM.__init__),
        "llm_engine": inspect.getsource(vllm.LLM.__init__),
        "engine_core": inspect.getsource(LLMEngine.__init__),
    }
    if name in init_sources:
        return f"self.{name} =" in init_sources[name] or f"self.{name}:" in init_sources[name]
    if name in {f.name for f in fields(ModelConfig)}:
        return True
    if name in {f.name for f in fields(CompletionOutput)}:
        return True
    return name == "shutdown" and callable(getattr(EngineCoreClient, "shutdown", None))


def test_every_attribute_the_backend_reads_by_name_exists_in_vllm(vllm, tree):
    missing = [n for n in sorted(getattr_names(tree) - NOT_VLLM) if not _owner_has(vllm, n)]
    assert not missing, f"read with getattr by the vllm backend but not found on vLLM's LLM, LLMEngine, ModelConfig or outputs: {missing}"


def test_every_vllm_import_of_the_backend_resolves(vllm, tree):
    for module, name in sorted(imported_vllm_names(tree)):
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"
    from vllm.inputs import TokensPrompt

    assert "prompt_token_ids" in typing.get_type_hints(TokensPrompt)


# ---------------------------------------------------------------------------- SamplingParams


def _sampling_variants() -> list[dict]:
    from opd_harness.backends import SamplingParams
    from opd_harness.backends.vllm_backend import last_token_kwargs, sampling_kwargs, score_sampling_kwargs

    ours = [
        SamplingParams(temperature=1.0, n=4, max_new_tokens=8, seed=3, top_p=0.9, top_k=20, presence_penalty=0.5, stop=("\n\n",)),
        SamplingParams(temperature=0.0, n=3, max_new_tokens=8),
        SamplingParams(temperature=0.7, max_new_tokens=2),
    ]
    return [sampling_kwargs(p, 1) for p in ours] + [
        score_sampling_kwargs(("logprobs", "topk"), 5), score_sampling_kwargs(("logprobs",), 0),
        last_token_kwargs(("logprobs", "topk"), 5, 42),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(6))
def test_every_sampling_params_the_backend_builds_is_a_valid_vllm_sampling_params(vllm, index):
    kwargs = _sampling_variants()[index]
    params = vllm.SamplingParams(**kwargs)
    for key, value in kwargs.items():
        got = getattr(params, key)
        assert (list(got) if isinstance(value, list) else got) == value, key  # taken as sent, not renamed or clamped
    assert params.flat_logprobs is False  # log-probs come back as a list of {token_id: Logprob} dicts, as the backend reads them


def test_what_the_backend_refuses_first_is_what_vllm_refuses_or_changes(vllm):
    """The premises of check_sampling_params and of the greedy n=1 rule, on the real SamplingParams."""
    from opd_harness.backends import MAX_TEMPERATURE, MIN_TEMPERATURE

    from vllm.exceptions import VLLMValidationError

    from fake_vllm import VLLMValidationError as FakeValidationError

    assert issubclass(FakeValidationError, ValueError) == issubclass(VLLMValidationError, ValueError)  # caught alike
    refused = (ValueError, VLLMValidationError)
    with pytest.raises(refused, match="temperature"):
        vllm.SamplingParams(temperature=MAX_TEMPERATURE + 0.5)
    vllm.SamplingParams(temperature=MAX_TEMPERATURE)  # the limit itself is allowed
    assert vllm.SamplingParams(temperature=MIN_TEMPERATURE / 2).temperature == MIN_TEMPERATURE  # silently raised
    with pytest.raises(refused, match="stop"):
        vllm.SamplingParams(stop=["\n", ""])
    with pytest.raises(refused, match="greedy"):
        vllm.SamplingParams(temperature=0.0, n=2)


# ---------------------------------------------------------------------------- outputs and the log-prob format


def _entries(vllm_logprobs, positions: list[tuple[int, float, int, list[tuple[int, float]]]], prompt: bool):
    """Log-probs built by vLLM's own builders: per position (sampled token, its log-prob, its rank, top-k (id, log-prob))."""
    built = vllm_logprobs.create_prompt_logprobs(False) if prompt else vllm_logprobs.create_sample_logprobs(False)
    for token, value, rank, top in positions:
        ids, values = [token] + [t for t, _ in top], [value] + [v for _, v in top]
        vllm_logprobs.append_logprobs_for_next_position(built, ids, values, [None] * len(ids), rank, len(top))
    return built


def test_generate_outputs_are_read_from_real_request_and_completion_outputs(vllm):
    from vllm import logprobs as vllm_logprobs
    from vllm.outputs import CompletionOutput, RequestOutput

    from opd_harness.backends.vllm_backend import request_to_completions

    def completion(index, tokens, values, reason):
        entries = _entries(vllm_logprobs, [(t, v, 1, []) for t, v in zip(tokens, values)], prompt=False)
        return CompletionOutput(index=index, text=f"s{index}", token_ids=tokens, cumulative_logprob=sum(values), logprobs=entries,
                                finish_reason=reason)  # fmt: skip

    outputs = [completion(1, [7, 2], [-0.5, -0.25], "length"), completion(0, [5, 2], [-1.5, -0.75], "stop")]
    request = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[3, 4], prompt_logprobs=None, outputs=outputs, finished=True)
    got = request_to_completions(request, prompt_index=2, n=2, eos_id=None)
    assert [(c.sample_index, c.token_ids, c.logprobs, c.finish_reason, c.text) for c in got] == [
        (0, [5, 2], [-1.5, -0.75], "stop", "s0"), (1, [7, 2], [-0.5, -0.25], "length", "s1"),
    ]  # fmt: skip


def test_prompt_logprobs_are_read_from_a_real_request_output(vllm):
    from vllm import logprobs as vllm_logprobs
    from vllm.outputs import CompletionOutput, RequestOutput

    from opd_harness.backends.prompt_logprobs import prompt_logprobs_to_tensor
    from opd_harness.backends.vllm_backend import forced_last_entry

    positions = [(11, -1.0, 3, [(20, -0.1), (21, -0.2)]), (12, -2.0, 1, [(12, -2.0), (22, -2.5)])]
    prompt = _entries(vllm_logprobs, positions, prompt=True)
    forced = CompletionOutput(index=0, text="", token_ids=[13], cumulative_logprob=None,
                              logprobs=_entries(vllm_logprobs, [(13, -3.0, 2, [(23, -0.3), (13, -3.0)])], prompt=False),
                              finish_reason="length")  # fmt: skip
    request = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[10, 11, 12], prompt_logprobs=prompt, outputs=[forced],
                            finished=True)  # fmt: skip
    entries = list(request.prompt_logprobs) + [forced_last_entry(request, 13, row=0)]
    ids = torch.tensor([[10, 11, 12, 13]])
    out = prompt_logprobs_to_tensor([entries], ids, torch.ones_like(ids), ("logprobs", "topk"), 2)
    assert out["logprobs"].tolist() == [[0.0, -1.0, -2.0, -3.0]]
    assert out["topk_ids"][0, 1:].tolist() == [[20, 21], [12, 22], [23, 13]]
    torch.testing.assert_close(out["topk_logprobs"][0, 1:], torch.tensor([[-0.1, -0.2], [-2.0, -2.5], [-0.3, -3.0]]))


def test_the_stand_in_outputs_carry_only_real_fields(vllm):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    from fake_vllm import completion_output, lp

    assert set(vars(completion_output([5, 1]))) <= {f.name for f in fields(CompletionOutput)}
    assert set(vars(lp(-0.5, 1))) == {f.name for f in fields(Logprob)}


# ---------------------------------------------------------------------------- the in-memory weight update


def test_the_weight_update_requests_are_the_ipc_engines_types(vllm):
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo

    from opd_harness.backends.vllm_backend import ipc_update_info

    state = {"a.weight": torch.ones(2, 3, dtype=torch.bfloat16), "b.bias": torch.zeros(4)}
    info = IPCWeightTransferUpdateInfo(**ipc_update_info(state, [{"uuid": ()}, {"uuid": ()}]))
    assert info.names == ["a.weight", "b.bias"] and info.dtype_names == ["bfloat16", "float32"] and info.shapes == [[2, 3], [4]]
    assert all(getattr(torch, d) in (torch.bfloat16, torch.float32) for d in info.dtype_names)  # names the worker resolves
    assert IPCWeightTransferInitInfo(**{"packed": False}).packed is False
    assert {f.name for f in fields(WeightTransferInitRequest)} == {"init_info"}  # the dict keys LLM's methods read
    assert {f.name for f in fields(WeightTransferUpdateRequest)} == {"update_info"}


def test_the_ipc_handles_are_keyed_as_the_worker_looks_them_up(vllm):
    """export_ipc keys each handle by the GPU's UUID and sends reduce_tensor's rebuild arguments: what
    IPCWeightTransferEngine.receive_weights reads (unpacked mode) and what vLLM's own IPC sender builds."""
    from vllm.distributed.weight_transfer import ipc_engine

    receive = compact(inspect.getsource(ipc_engine.IPCWeightTransferEngine.receive_weights))
    send = compact(inspect.getsource(ipc_engine.IPCTrainerWeightTransferEngine._send_unpacked))
    assert "str(props.uuid)" in receive and "rebuild_cuda_tensor(*list_args)" in receive
    assert "_,ipc_args=reduce_tensor(weight)" in send and "{self.gpu_uuid:ipc_args}" in send
    finish = compact(inspect.getsource(ipc_engine.IPCWeightTransferEngine.finish_weight_update))
    assert "finalize_layerwise_reload" in finish  # the update lands in the model only at finish
    assert "self.model.load_weights(weights)" in receive  # the model's own loader maps HF names onto vLLM's parameters


def test_the_worker_extension_is_mixed_in_as_the_backend_expects(vllm):
    """vLLM mixes worker_extension_cls into the worker class, so collective_rpc reaches WeightCheck's methods by name."""
    from vllm.v1.worker import worker_base

    source = compact(inspect.getsource(worker_base.WorkerWrapperBase))
    assert "resolve_obj_by_qualname(parallel_config.worker_extension_cls)" in source and "worker_class.__bases__" in source

