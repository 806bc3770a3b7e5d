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

**Source mode** (``HARNESS_VLLM_SOURCE=DIR``, a folder holding the ``vllm`` package's ``.py`` files; every CI run, from
the wheel: ``.ci/legs/vllm_source.sh``): the ``test_source_*`` tests read vLLM's source with ``ast``
(``tests/vllm_source.py``) instead of importing it, and the import-mode tests skip. They check the same surface from the
same scans of the product's source: the names imported (re-exports and ``vllm/__init__.py``'s lazy ``__getattr__`` map
followed), ``LLM``'s construction arguments (``LLM.__init__`` parameters or ``EngineArgs`` fields), every ``LLM`` method
called (signatures found through the mixins), ``SamplingParams`` fields, the ``Worker`` methods the weight transfer
reaches, the outputs' fields and log-prob types, the weight-transfer request types, ``__version__``. What only import
mode does, being behaviour: ``EngineArgs(**sent)`` converting the values, ``SamplingParams`` keeping the values as sent
and refusing what the backend refuses first, the log-prob builders' output read by the backend's helpers, the IPC info
dataclasses built from ``ipc_update_info``, ``resolve_obj_by_qualname`` finding the worker extension. Source mode checks
their signatures, fields, ``Literal`` values and the constants ``tests/fake_vllm.py`` copies instead. Without
``HARNESS_VLLM_SOURCE`` the source-mode tests read the installed vllm's files (found, not imported), so the opt-in leg
runs both modes on the same release. The ``src`` fixture prints what it verified (``-s``): the table of
``docs/guides/vllm.md``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import shutil
import tomllib
import typing
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_source import External, Found, NotFound, VLLMSource

ROOT = Path(__file__).resolve().parents[1]
BACKEND_SOURCE = ROOT / "harness" / "backends" / "vllm_backend.py"
WORKER_SOURCE = ROOT / "harness" / "backends" / "vllm_worker.py"
PROMPT_LOGPROBS_SOURCE = ROOT / "harness" / "backends" / "prompt_logprobs.py"  # reads vLLM's Logprob by name
VLLM_VERSION = "0.33.0"  # the version the gpu extra pins and this file checks
REQUIRE_VLLM = os.environ.get("HARNESS_REQUIRE_VLLM") == "1"
SOURCE_DIR = os.environ.get("HARNESS_VLLM_SOURCE")  # source mode: vLLM read from this folder, never imported


def _vllm():
    """The installed vllm, or a skip (a failure under ``HARNESS_REQUIRE_VLLM=1``; a skip in source mode)."""
    if SOURCE_DIR:
        pytest.skip("source mode (HARNESS_VLLM_SOURCE): vLLM is read, not imported")
    if importlib.util.find_spec("vllm") is None:
        missing("vllm is not installed (it has its own environment: .ci/legs/vllm.sh)")
    return importlib.import_module("vllm")


def missing(reason: str) -> None:
    """vLLM (or its source) is not here: a skip, a failure under ``HARNESS_REQUIRE_VLLM=1`` (the CI legs)."""
    if REQUIRE_VLLM:
        pytest.fail(f"HARNESS_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def compact(source: str) -> str:
    """Source without whitespace, so a reformatting upstream does not fail a check of what the code does."""
    return "".join(source.split())


@pytest.fixture(scope="module")
def vllm():
    return _vllm()


def _imported(dotted: str):
    """``"module:Qual.name"`` from the imported vllm (``"module:"``: the module)."""
    module, _, path = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def _imported_has(dotted: str) -> bool:
    try:
        _imported(dotted)
    except AttributeError:
        return False
    return True


@pytest.fixture(params=["import", "source"])
def api(request) -> SimpleNamespace:
    """vLLM's definitions by ``"module:Qual.name"`` in both modes: ``signature``, ``text`` (source without whitespace)
    and ``has``, from the imported vllm (``inspect``) or from its files (``tests/vllm_source.py``)."""
    if request.param == "import":
        request.getfixturevalue("vllm")
        return SimpleNamespace(signature=lambda d: inspect.signature(_imported(d)), text=lambda d: compact(inspect.getsource(_imported(d))),
                               has=_imported_has)  # fmt: skip
    return source_api(request.getfixturevalue("src"))


def source_api(src: VLLMSource) -> SimpleNamespace:
    """The ``api`` fixture's reader over vLLM's files (every definition read is recorded for the table)."""

    def has(dotted: str) -> bool:
        try:
            src.lookup(dotted)
        except NotFound:
            return False
        return True

    return SimpleNamespace(signature=lambda d: src.signature(verified(src, d)), text=lambda d: compact(src.text(verified(src, d))), has=has)


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


def vllm_module_names(tree: ast.AST) -> set[str]:
    """Names read from the ``vllm`` module itself: ``vllm.X`` and ``import_vllm().X``."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and (
            (isinstance(node.value, ast.Name) and node.value.id == "vllm")
            or (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "import_vllm")
        )
    }  # fmt: skip


# The backend's variables that hold vLLM's outputs -> their class; ``outputs[i]`` is an element of RequestOutput.outputs.
OUTPUT_VARIABLES = {
    "request_output": "RequestOutput", "output": "CompletionOutput", "o": "CompletionOutput", "outputs[]": "CompletionOutput",
}  # fmt: skip


def output_reads(tree: ast.AST) -> dict[str, set[str]]:
    """Attributes read (``x.name``) on the variables of ``OUTPUT_VARIABLES``: class -> names."""
    reads: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            value = node.value
            key = value.id if isinstance(value, ast.Name) else f"{value.value.id}[]" if (
                isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)) else None  # fmt: skip
            if key in OUTPUT_VARIABLES:
                reads.setdefault(OUTPUT_VARIABLES[key], set()).add(node.attr)
    return reads


def self_calls(tree: ast.AST, cls: str) -> set[str]:
    """Methods class ``cls`` calls on ``self`` without defining them: the worker's, for a worker extension."""
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    defined = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return {
        n.func.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    } - defined  # fmt: skip


@pytest.fixture(scope="module")
def tree() -> ast.AST:
    return ast.parse(BACKEND_SOURCE.read_text())


@pytest.fixture(scope="module")
def worker_tree() -> ast.AST:
    return ast.parse(WORKER_SOURCE.read_text())


@pytest.fixture(scope="module")
def logprobs_tree() -> ast.AST:
    return ast.parse(PROMPT_LOGPROBS_SOURCE.read_text())


def test_the_source_scan_finds_the_calls_it_must(tree, worker_tree, logprobs_tree):
    """The scanners above are not vacuous: they see the calls the module docstring describes."""
    calls = llm_calls(tree)
    for name in ("generate", "collective_rpc", "reset_prefix_cache", "start_weight_update", "update_weights", "finish_weight_update"):
        assert name in calls, name
    assert rpc_methods(tree) == {"harness_param_shapes", "harness_checksum"}
    assert {"model_config", "llm_engine", "engine_core"} <= getattr_names(tree)
    assert ("vllm.inputs", "TokensPrompt") in imported_vllm_names(tree)
    assert {"LLM", "SamplingParams"} <= vllm_module_names(tree)
    reads = output_reads(tree)
    assert {"outputs", "prompt_logprobs"} <= reads["RequestOutput"] and {"token_ids", "text", "logprobs"} <= reads["CompletionOutput"]
    assert "get_model" in self_calls(worker_tree, "WeightCheck")
    assert {"logprob", "rank"} <= getattr_names(logprobs_tree)


# ---------------------------------------------------------------------------- version and engine construction


def _the_extra_admits(version: str) -> None:
    """The vllm extra users install admits the version this file checks the backend against."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(r).specifier for r in extras["vllm"] if Requirement(r).name == "vllm"]
    assert version in spec


def test_the_installed_vllm_is_the_pinned_one(vllm):
    assert vllm.__version__ == VLLM_VERSION
    _the_extra_admits(VLLM_VERSION)


def _sent_engine_kwargs(monkeypatch, model: str, **options) -> dict:
    """The keyword arguments ``VLLMBackend.load`` gives ``vllm.LLM`` (captured from the module ``import_vllm`` returns,
    so no vllm is needed; no engine is started)."""
    from opd_harness.backends import vllm_backend

    sent = {}

    class Captured(Exception):
        pass

    def capture(**kwargs):
        sent.update(kwargs)
        raise Captured

    monkeypatch.setattr(vllm_backend, "import_vllm", lambda: SimpleNamespace(LLM=capture))
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(Captured):
        vllm_backend.VLLMBackend.load(model, **options)
    return sent


def _engine_kwargs(monkeypatch, tmp_path) -> dict:
    """What the backend sends ``vllm.LLM`` with every optional argument given (the model a local folder)."""
    return _sent_engine_kwargs(monkeypatch, str(tmp_path), max_model_len=256, enable_prefix_caching="true")


def test_every_engine_argument_the_backend_passes_is_accepted_by_llm_and_engine_args(vllm, monkeypatch, tmp_path):
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import EngineArgs

    sent = _engine_kwargs(monkeypatch, tmp_path)
    llm_params = inspect.signature(vllm.LLM.__init__).parameters
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


def _bind(signature: inspect.Signature, positional: int, keywords: tuple[str, ...], what: str = "") -> None:
    """Bind dummy arguments as the backend passes them (after ``self``); a missing or renamed parameter fails naming
    ``what`` (the callable and where it is), the signature and the arguments."""
    try:
        signature.bind(object(), *([object()] * positional), **{k: object() for k in keywords})
    except TypeError as exc:
        raise AssertionError(f"{what}{signature} does not take {positional} positional arguments and {keywords}: {exc}") from None


def test_every_llm_method_the_backend_calls_exists_and_takes_its_arguments(api, tree):
    for method, uses in sorted(llm_calls(tree).items()):
        assert api.has(f"vllm:LLM.{method}"), f"vllm.LLM has no method {method}"
        signature = api.signature(f"vllm:LLM.{method}")
        for positional, keywords in uses:
            _bind(signature, positional, keywords, f"vllm.LLM.{method}")


def test_the_stand_in_engine_has_the_real_signatures(api, tree):
    """tests/fake_vllm.py's FakeLLM takes exactly the parameters vllm.LLM's methods take, for every method the backend calls."""
    from fake_vllm import FakeLLM

    for method in sorted(llm_calls(tree)):
        real = [(p.name, p.kind) for p in api.signature(f"vllm:LLM.{method}").parameters.values()]
        fake = [(p.name, p.kind) for p in inspect.signature(getattr(FakeLLM, method)).parameters.values()]
        assert fake == real, f"FakeLLM.{method}{fake} != vllm.LLM.{method}{real}"


WORKER = "vllm.v1.worker.gpu_worker:Worker"
WEIGHT_TRANSFER_WORKER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def test_the_stand_in_worker_has_the_real_worker_methods(api, worker_tree):
    """The methods the weight-transfer calls reach on each worker (vllm/entrypoints/rl/offline.py) and those the worker
    extension calls on ``self`` exist on vLLM's ``Worker`` with the stand-in worker's parameters, and the worker
    extension's methods clash with none of Worker's (vLLM refuses such an extension)."""
    from fake_vllm import FakeWorker

    from opd_harness.backends.vllm_worker import WeightCheck

    offline = api.text("vllm.entrypoints.rl.offline:")
    for method in (*WEIGHT_TRANSFER_WORKER_METHODS, *sorted(self_calls(worker_tree, "WeightCheck"))):
        assert api.has(f"{WORKER}.{method}"), f"vLLM's Worker has no method {method}"
        real = list(api.signature(f"{WORKER}.{method}").parameters)
        assert list(inspect.signature(getattr(FakeWorker, method)).parameters) == real, method
        assert method not in WEIGHT_TRANSFER_WORKER_METHODS or f'collective_rpc("{method}"' in offline
    assert not [a for a in dir(WeightCheck) if not a.startswith("__") and api.has(f"{WORKER}.{a}")]


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


def test_the_ipc_handles_are_keyed_as_the_worker_looks_them_up(api):
    """export_ipc keys each handle by the GPU's UUID and sends reduce_tensor's rebuild arguments: what
    IPCWeightTransferEngine.receive_weights reads (unpacked mode) and what vLLM's own IPC sender builds."""
    ipc_engine = "vllm.distributed.weight_transfer.ipc_engine"
    receive = api.text(f"{ipc_engine}:IPCWeightTransferEngine.receive_weights")
    send = api.text(f"{ipc_engine}:IPCTrainerWeightTransferEngine._send_unpacked")
    assert "str(props.uuid)" in receive and "rebuild_cuda_tensor(*list_args)" in receive
    assert "_,ipc_args=reduce_tensor(weight)" in send and "{self.gpu_uuid:ipc_args}" in send
    finish = api.text(f"{ipc_engine}:IPCWeightTransferEngine.finish_weight_update")
    assert "finalize_layerwise_reload" in finish  # the update lands in the model only at finish
    assert "self.model.load_weights(weights)" in receive  # the model's own loader maps HF names onto vLLM's parameters


def test_the_worker_extension_is_mixed_in_as_the_backend_expects(api):
    """vLLM mixes worker_extension_cls into the worker class, so collective_rpc reaches WeightCheck's methods by name."""
    source = api.text("vllm.v1.worker.worker_base:WorkerWrapperBase")
    assert "resolve_obj_by_qualname(parallel_config.worker_extension_cls)" in source and "worker_class.__bases__" in source



# ---------------------------------------------------------------------------- source mode: vLLM read, not imported

VERIFIED: dict[str, str] = {}  # what the source-mode checks found: the definition as verified -> file:line


def _source_root() -> Path:
    """``HARNESS_VLLM_SOURCE``, else the installed vllm's folder (found without importing it), else a skip (a failure
    under ``HARNESS_REQUIRE_VLLM=1``)."""
    if SOURCE_DIR:
        return Path(SOURCE_DIR)
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        missing("no vLLM source: set HARNESS_VLLM_SOURCE to a folder holding the vllm package's files (.ci/legs/vllm_source.sh)")
    return Path(list(spec.submodule_search_locations)[0]).parent


def surface_table(src: VLLMSource) -> str:
    """What the source-mode checks verified, as the markdown table of docs/guides/vllm.md."""
    version = src.value(src.lookup("vllm:__version__"))
    rows = [f"| `{what}` | `{where}` |" for what, where in sorted(VERIFIED.items())]
    header = [f"\nvLLM API surface verified in vllm {version} ({len(rows)} definitions):\n", f"| verified | in vllm {version} |",
              "|---|---|"]  # fmt: skip
    return "\n".join([*header, *rows])


@pytest.fixture(scope="module")
def src():
    try:
        source = VLLMSource(_source_root())
    except NotFound as exc:
        pytest.fail(str(exc), pytrace=False)
    VERIFIED.clear()
    yield source
    if VERIFIED:
        table = surface_table(source)
        print(table)
        documented = {line for line in (ROOT / "docs" / "guides" / "vllm.md").read_text().splitlines() if line.startswith("| `")}
        differ = documented ^ {line for line in table.splitlines() if line.startswith("| `")}
        if differ:  # a note, not a failure: a run of some of the tests records part of the table
            print(f"docs/guides/vllm.md's table differs from this run's in {len(differ)} rows; after a full run, paste this table there")


def describe(src: VLLMSource, found: Found) -> str:
    """One line for the table: a function's or class's signature, a field or constant as written."""
    node = found.node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{found.name}{src.signature(found)}"
    if isinstance(node, ast.ClassDef):
        decorators = "".join(f"@{ast.unparse(d)} " for d in node.decorator_list)
        bases = f"({', '.join(ast.unparse(b) for b in node.bases)})" if node.bases else ""
        return f"{decorators}class {found.name}{bases}"
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        owner = found.name.rpartition(".")[0]
        return f"{owner + '.' if owner else ''}{ast.unparse(node)}"
    return f"module {found.name}"


def record(src: VLLMSource, found: Found, what: str | None = None) -> Found:
    VERIFIED[what or describe(src, found)] = found.where
    return found


def verified(src: VLLMSource, dotted: str) -> Found:
    """``src.lookup(dotted)``, recorded for the table."""
    return record(src, src.lookup(dotted))


def literal_values(found: Found) -> set:
    """The values of ``X = Literal[...]`` (or a field annotated ``Literal[...] | str``)."""
    node = found.node
    expr = node.value if isinstance(node, ast.Assign) else node.annotation
    return {n.value for n in ast.walk(expr) if isinstance(n, ast.Constant)}


def self_assigned(function: Found) -> dict[str, Found]:
    """``self.NAME`` targets assigned in a method (``__init__``): NAME -> the first assignment."""
    out: dict[str, Found] = {}
    for n in sorted(ast.walk(function.node), key=lambda n: getattr(n, "lineno", 0)):
        for t in n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr not in out:
                out[t.attr] = Found(function.module, f"{function.name}: self.{t.attr}", n, function.path, function.root)
    return out


def imported_calls(tree: ast.AST) -> dict[str, list[tuple[int, tuple[str, ...]]]]:
    """Calls of names imported from vllm (``TokensPrompt(prompt_token_ids=...)``): name -> [(positional count, keywords)]."""
    names = {name for _, name in imported_vllm_names(tree)}
    calls: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            calls.setdefault(node.func.id, []).append((len(node.args), tuple(k.arg for k in node.keywords if k.arg is not None)))
    return calls


def test_source_the_vllm_source_is_the_pinned_version(src):
    """``vllm.__version__`` followed through ``vllm/version.py`` to the generated ``vllm/_version.py``."""
    version = src.value(verified(src, "vllm:__version__"))
    assert version == VLLM_VERSION, f"the vLLM source read is {version}, this file checks {VLLM_VERSION}"
    _the_extra_admits(version)


def test_source_every_vllm_name_the_backend_uses_resolves(src, tree):
    """``from vllm.x import Y`` and ``vllm.Y`` (``import_vllm().Y``) of the backend, through re-exports and the lazy
    ``__getattr__`` map of ``vllm/__init__.py``; every call of an imported name binds its arguments."""
    names = sorted(imported_vllm_names(tree) | {("vllm", n) for n in vllm_module_names(tree)})
    for module, name in names:
        verified(src, f"{module}:{name}")
    for name, uses in imported_calls(tree).items():
        (module,) = [m for m, n in imported_vllm_names(tree) if n == name]
        called = src.lookup(f"{module}:{name}")
        signature = src.signature(called)
        for positional, keywords in uses:
            _bind(signature, positional, keywords, f"{module}.{name} ({called.where}) ")
            fields_ = src.fields(called)
            for keyword in keywords:
                if keyword in fields_:
                    record(src, fields_[keyword])


def test_source_every_engine_argument_is_an_llm_parameter_or_an_engine_args_field(src, monkeypatch, tmp_path):
    """The arguments ``VLLMBackend.load`` sends ``vllm.LLM`` (captured), against ``LLM.__init__`` and ``EngineArgs``'s
    fields (where ``LLM`` sends its ``**kwargs``); the values the engine validates: ``logprobs_mode`` among
    ``LogprobsMode``'s literals, the weight-transfer backend registered with ``WeightTransferEngineFactory``."""
    sent = _engine_kwargs(monkeypatch, tmp_path)
    init = src.lookup("vllm:LLM.__init__")
    params = {p.name: p for p in src.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    engine_args = verified(src, "vllm:EngineArgs")
    engine_fields = src.fields(engine_args)
    assert "**" in str(src.signature(init)) and "EngineArgs(" in compact(src.text(init)), "LLM.__init__ sends no **kwargs to EngineArgs"
    for key in sorted(sent):
        if key in params:
            record(src, init, f"LLM.__init__(..., {params[key]}, ...)")
        else:
            where = f"({init.where}) nor as an EngineArgs field ({engine_args.where})"
            assert key in engine_fields, f"vllm.LLM takes {key} neither as a parameter {where}"
            record(src, engine_fields[key])
    mode = engine_fields["logprobs_mode"]
    assert ast.unparse(mode.node.annotation) == "LogprobsMode"
    assert sent["logprobs_mode"] in literal_values(verified(src, f"{mode.module}:LogprobsMode"))
    assert ast.unparse(engine_fields["worker_extension_cls"].node.annotation) == "str"  # a qualified name, as EXTENSION is
    transfer = engine_fields["weight_transfer_config"]
    assert "WeightTransferConfig" in ast.unparse(transfer.node.annotation)
    config_fields = src.fields(verified(src, f"{transfer.module}:WeightTransferConfig"))
    assert set(sent["weight_transfer_config"]) <= set(config_fields), sorted(config_fields)
    factory = verified(src, "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory")
    registered = {
        n.args[0].value
        for n in ast.walk(src.module(factory.module)[0])
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "register_engine"
        and isinstance(n.func.value, ast.Name) and n.func.value.id == factory.name and n.args and isinstance(n.args[0], ast.Constant)
    }  # fmt: skip
    from opd_harness.backends.vllm_backend import WEIGHT_TRANSFER

    assert WEIGHT_TRANSFER["backend"] in registered, f"{factory.where}: registered weight-transfer backends {sorted(registered)}"
    verified(src, "vllm.utils.import_utils:resolve_obj_by_qualname")  # how the worker finds worker_extension_cls


def _source_owner(src: VLLMSource, name: str) -> Found | None:
    """Where a name the backend reads with getattr is defined: set in ``LLM.__init__``/``LLMEngine.__init__``, a field of
    ``ModelConfig``, ``CompletionOutput`` or ``Logprob``, or ``EngineCoreClient.shutdown``."""
    for init in ("vllm:LLM.__init__", "vllm.v1.engine.llm_engine:LLMEngine.__init__"):
        assigned = self_assigned(src.lookup(init))
        if name in assigned:
            return record(src, assigned[name], assigned[name].name)
    for cls in ("vllm.config.model:ModelConfig", "vllm:CompletionOutput", "vllm.logprobs:Logprob"):
        field = src.fields(src.lookup(cls)).get(name)
        if field is not None:
            return record(src, field)
    return verified(src, "vllm.v1.engine.core_client:EngineCoreClient.shutdown") if name == "shutdown" else None


def test_source_every_attribute_the_backend_reads_by_name_exists_in_vllm(src, tree, logprobs_tree):
    names = (getattr_names(tree) | getattr_names(logprobs_tree)) - NOT_VLLM
    missing = [n for n in sorted(names) if _source_owner(src, n) is None]
    assert not missing, f"read with getattr by the vllm backend but not found on vLLM's LLM, LLMEngine, ModelConfig or outputs: {missing}"


def test_source_every_sampling_params_key_the_backend_sends_is_a_field(src):
    """Source mode cannot build ``SamplingParams`` (import mode checks the values are kept as sent): every key the backend
    sends is a field of the ``msgspec.Struct``, and log-probs come back as lists of dicts (``flat_logprobs`` False)."""
    params = verified(src, "vllm:SamplingParams")
    assert src.is_field_class(params)
    available = src.fields(params)
    for key in sorted({k for kwargs in _sampling_variants() for k in kwargs}):
        assert key in available, f"vllm.SamplingParams ({params.where}) has no field {key}, which the vllm backend sends"
        record(src, available[key])
    assert src.value(available["flat_logprobs"]) is False


def test_source_what_the_backend_refuses_first_is_what_vllm_refuses_or_changes(src):
    """Source mode's reading of the refusals import mode provokes: the limits in ``SamplingParams``'s checks, the clamp
    constant, and the error's class, which the stand-in (``tests/fake_vllm.py``) copies."""
    import fake_vllm

    from opd_harness.backends import MAX_TEMPERATURE, MIN_TEMPERATURE

    checks = compact(src.text(verified(src, "vllm:SamplingParams._verify_args")))
    assert f"ifself.temperature>{MAX_TEMPERATURE}:" in checks and "ifany(notstop_strforstop_strinself.stop):" in checks
    assert "nmustbe1whenusinggreedysampling" in compact(src.text(verified(src, "vllm:SamplingParams._verify_greedy_sampling")))
    assert src.value(verified(src, "vllm.sampling_params:_MAX_TEMP")) == MIN_TEMPERATURE == fake_vllm.MAX_TEMP_CLAMP
    assert src.value(verified(src, "vllm.sampling_params:_SAMPLING_EPS")) == fake_vllm.SAMPLING_EPS
    assert src.value(verified(src, "vllm.v1.serial_utils:CUSTOM_TYPE_RAW_VIEW")) == fake_vllm.CUSTOM_TYPE_RAW_VIEW
    ancestors = {a.qualname for a in src.mro(verified(src, "vllm.exceptions:VLLMValidationError")) if isinstance(a, External)}
    assert ("builtins.ValueError" in ancestors) == issubclass(fake_vllm.VLLMValidationError, ValueError)  # caught alike


def test_source_the_outputs_have_what_the_backend_reads(src, tree):
    """``RequestOutput``/``CompletionOutput`` carry every attribute the backend reads, the log-prob types are lists of
    ``{token_id: Logprob}`` dicts, and the constructors and log-prob builders import mode calls take those arguments
    (source mode cannot run the builders)."""
    request, completion = verified(src, "vllm:RequestOutput"), verified(src, "vllm:CompletionOutput")
    request_init = src.member(request, "__init__")
    reads = output_reads(tree)
    assigned = self_assigned(request_init)
    for name in sorted(reads["RequestOutput"]):
        assert name in assigned, f"vllm.RequestOutput ({request_init.where}) sets no attribute {name}"
        record(src, assigned[name], assigned[name].name)
    completion_fields = src.fields(completion)
    for name in sorted(reads["CompletionOutput"]):
        assert name in completion_fields, f"vllm.CompletionOutput ({completion.where}) has no field {name}"
        record(src, completion_fields[name])
    named = {p.name for p in src.signature(request).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert {"request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished"} <= named  # not swallowed by **kwargs
    assert {"index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason"} <= set(completion_fields)
    assert "PromptLogprobs" in ast.unparse(request_init.node.args.args[4].annotation)
    assert "SampleLogprobs" in ast.unparse(completion_fields["logprobs"].node.annotation)
    one = ast.unparse(verified(src, "vllm.logprobs:LogprobsOnePosition").node.value)
    assert one == "dict[int, Logprob]", one
    assert "list[LogprobsOnePosition | None]" in ast.unparse(verified(src, "vllm.logprobs:PromptLogprobs").node.value)
    assert "list[LogprobsOnePosition]" in ast.unparse(verified(src, "vllm.logprobs:SampleLogprobs").node.value)
    assert {"logprob", "rank"} <= set(src.fields(verified(src, "vllm.logprobs:Logprob")))
    for builder, positional in (("create_prompt_logprobs", 1), ("create_sample_logprobs", 1), ("append_logprobs_for_next_position", 6)):
        src.signature(verified(src, f"vllm.logprobs:{builder}")).bind(*[object()] * positional)


def test_source_the_stand_in_outputs_carry_only_real_fields(src):
    from fake_vllm import completion_output, lp

    assert set(vars(completion_output([5, 1]))) <= set(src.fields(src.lookup("vllm:CompletionOutput")))
    assert set(vars(lp(-0.5, 1))) == set(src.fields(src.lookup("vllm.logprobs:Logprob")))


def test_source_the_weight_update_requests_are_the_ipc_engines_types(src):
    """Source mode cannot build the IPC info dataclasses from ``ipc_update_info`` (import mode does): their fields are
    the keys the backend sends, and every field without a default is sent."""
    from opd_harness.backends.vllm_backend import ipc_update_info

    base, ipc = "vllm.distributed.weight_transfer.base", "vllm.distributed.weight_transfer.ipc_engine"
    assert set(src.fields(verified(src, f"{base}:WeightTransferInitRequest"))) == {"init_info"}  # the dict keys LLM's methods read
    assert set(src.fields(verified(src, f"{base}:WeightTransferUpdateRequest"))) == {"update_info"}
    assert "packed" in src.fields(verified(src, f"{ipc}:IPCWeightTransferInitInfo"))
    update = verified(src, f"{ipc}:IPCWeightTransferUpdateInfo")
    sent = set(ipc_update_info({"a.weight": torch.ones(2, 3)}, [{"uuid": ()}]))
    available = src.fields(update)
    assert sent <= set(available), f"IPCWeightTransferUpdateInfo ({update.where}) lacks {sorted(sent - set(available))}"
    required = {name for name, f in available.items() if f.node.value is None}
    assert required <= sent, f"IPCWeightTransferUpdateInfo requires {sorted(required - sent)}, which the backend does not send"
    for name in sorted(sent):
        record(src, available[name])


# ---------------------------------------------------------------------------- the source checks fail on a rename


def _write_tree(root: Path, files: dict[str, str]) -> VLLMSource:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return VLLMSource(root)


def _mini_vllm(root: Path, sampling_fields: list[str]) -> VLLMSource:
    """A small vllm package laid out as 0.33.0's: a lazy ``__getattr__`` map (and a wrong ``TYPE_CHECKING`` import it
    must not follow), a version behind a ``try``/``except`` fallback, a method inherited from a mixin in another module,
    a ``msgspec.Struct`` with the given fields."""
    struct = "".join(f"    {name}: int | None = None\n" for name in sampling_fields)
    return _write_tree(root, {
        "vllm/__init__.py": (
            "import typing\nfrom .version import __version__\n"
            "MODULE_ATTRS = {'LLM': '.entrypoints.llm:LLM', 'SamplingParams': '.sampling_params:SamplingParams'}\n"
            "if typing.TYPE_CHECKING:\n    from vllm.entrypoints.llm import Wrong as SamplingParams\nelse:\n"
            "    def __getattr__(name):\n        raise AttributeError(name)\n"
        ),
        "vllm/version.py": "try:\n    from ._version import __version__\nexcept Exception:\n    __version__ = 'dev'\n",
        "vllm/_version.py": "__version__: str\n__version__ = version = '0.33.0'\n",
        "vllm/sampling_params.py": f"import msgspec\nfrom typing import ClassVar\n\nclass SamplingParams(msgspec.Struct):\n{struct}"
                                   "    flat_logprobs: bool = False\n    cap: ClassVar[int] = 2\n",
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/llm.py": "from vllm.entrypoints.rl.offline import RLOfflineMixin\n\nclass LLM(RLOfflineMixin):\n    pass\n",
        "vllm/entrypoints/rl/__init__.py": "",
        "vllm/entrypoints/rl/offline.py": "class RLOfflineMixin:\n    def finish_weight_update(self, weight_version=None):\n        pass\n",
    })  # fmt: skip


@pytest.fixture
def own_table():
    """What checks on a made-up or altered tree record stays out of the printed table."""
    saved = dict(VERIFIED)
    yield
    VERIFIED.clear()
    VERIFIED.update(saved)


def _sent_sampling_keys() -> list[str]:
    return sorted({k for kwargs in _sampling_variants() for k in kwargs})


def test_the_source_reader_follows_lazy_exports_fallbacks_and_bases(tmp_path):
    src = _mini_vllm(tmp_path, ["n", "max_tokens"])
    assert src.value(src.lookup("vllm:__version__")) == "0.33.0"  # the try body's import, not the except fallback
    assert src.lookup("vllm:SamplingParams").where == "vllm/sampling_params.py:4"  # the lazy map, not the TYPE_CHECKING import
    assert list(src.fields(src.lookup("vllm:SamplingParams"))) == ["n", "max_tokens", "flat_logprobs"]  # no ClassVar
    inherited = src.lookup("vllm:LLM.finish_weight_update")
    assert inherited.where == "vllm/entrypoints/rl/offline.py:2"
    _bind(src.signature(inherited), 0, ("weight_version",))
    with pytest.raises(NotFound, match="vllm defines no Nonesuch"):
        src.lookup("vllm:Nonesuch")
    with pytest.raises(NotFound, match=r"LLM \(vllm/entrypoints/llm.py:3\) has no member update_weights \(searched LLM -> RLOfflineMixin"):
        src.lookup("vllm:LLM.update_weights")


def test_a_sampling_params_field_renamed_upstream_fails_naming_it(tmp_path, own_table):
    """The failure mode: vLLM renames a field the backend sends (here ``max_tokens``); the source check names it. The
    same check passes on the tree before the rename, so the failure is the rename's."""
    keys = _sent_sampling_keys()
    assert "max_tokens" in keys
    test_source_every_sampling_params_key_the_backend_sends_is_a_field(_mini_vllm(tmp_path / "before", keys))
    renamed = [("max_new_tokens" if k == "max_tokens" else k) for k in keys]
    with pytest.raises(AssertionError, match="has no field max_tokens, which the vllm backend sends"):
        test_source_every_sampling_params_key_the_backend_sends_is_a_field(_mini_vllm(tmp_path / "after", renamed))


# vLLM's real source with one change -> the source-mode test that must catch it, and what its failure must name.
RENAMES = {
    "sampling-field": ("vllm/sampling_params.py", "\n    max_tokens: int | None = 16\n", "\n    max_new_tokens: int | None = 16\n",
                       "sampling", "has no field max_tokens"),
    "method-kwarg": ("vllm/entrypoints/rl/offline.py", "def finish_weight_update(self, weight_version:",
                     "def finish_weight_update(self, version:", "llm_methods", r"finish_weight_update.*\('weight_version',\)"),
    "lazy-export": ("vllm/__init__.py", '\n    "SamplingParams": ".sampling_params:SamplingParams",', "",
                    "names", "vllm defines no SamplingParams"),
}  # fmt: skip


@pytest.mark.parametrize("change", sorted(RENAMES))
def test_a_change_upstream_fails_the_source_checks_on_the_real_tree(src, tree, tmp_path, own_table, change):
    """A copy of the source read (links, one file rewritten) with a field renamed, a keyword renamed or a lazy export
    dropped: the source-mode test for it fails naming what the backend uses."""
    path, old, new, check, message = RENAMES[change]
    copy = tmp_path / "src"
    shutil.copytree(src.root / "vllm", copy / "vllm", copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__"))
    text = (src.root / path).read_text()
    assert text.count(old) == 1, f"{path} no longer holds {old!r}: update RENAMES"
    (copy / path).unlink()
    (copy / path).write_text(text.replace(old, new))
    altered = VLLMSource(copy)
    run = {
        "sampling": lambda: test_source_every_sampling_params_key_the_backend_sends_is_a_field(altered),
        "llm_methods": lambda: test_every_llm_method_the_backend_calls_exists_and_takes_its_arguments(source_api(altered), tree),
        "names": lambda: test_source_every_vllm_name_the_backend_uses_resolves(altered, tree),
    }[check]
    with pytest.raises((AssertionError, NotFound), match=message):
        run()
