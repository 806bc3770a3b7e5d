"""vLLM backend: CPU tests of the pure helpers and plumbing (fake vLLM objects), GPU tests against HF.

The CPU tests never import vllm. The ``gpu`` tests need CUDA and an importable vllm (a separate
environment, see DEVELOPERS.md) and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from opd_harness.backends import Completion, SamplingParams
from opd_harness.backends import vllm_backend
from opd_harness.backends.vllm_backend import (
    RAW_LOGPROBS,
    VLLMBackend,
    WeightSyncError,
    check_engine_load,
    probe_names,
    check_score_request,
    request_to_completions,
    sampling_kwargs,
    score_sampling_kwargs,
    to_completion,
)
from opd_harness.backends.prompt_logprobs import prompt_logprobs_to_tensor, topk_from_entry
from opd_harness.backends.vllm_worker import EXTENSION
from opd_harness.backends.weight_check import checksum

from fake_vllm import (
    ENGINE_LOGPROB_SCALE,
    EOS,
    FakeLLM,
    FakeModel,
    FakeSamplingParams,
    HFEngineLLM,
    VLLMValidationError,
    completion_output,
    fake_export,
    fake_vllm_module,
    hf_state,
    lp,
    utility_round_trip,
)

# ---------------------------------------------------------------------------- import hygiene and the missing-vllm error


def test_importing_the_module_does_not_import_vllm():
    code = (
        "import sys, opd_harness.backends.vllm_backend as m; from opd_harness.registry import BACKENDS; "
        "assert BACKENDS.get('vllm') is m.VLLMBackend; "
        "print(sorted(k for k in sys.modules if k == 'vllm' or k.startswith('vllm.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_load_without_vllm_raises_a_clear_runtime_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError, even where vllm is installed
    with pytest.raises(RuntimeError, match=r"install the gpu extra in a separate environment.*DEVELOPERS\.md"):
        VLLMBackend.load("/no/such/model")


def test_load_passes_engine_options_and_forces_raw_logprobs(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(FakeLLM))
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    backend = VLLMBackend.load(
        "/m",
        tensor_parallel_size="2",
        gpu_memory_utilization="0.3",
        dtype="float32",
        max_model_len="256",
        enforce_eager="true",
        max_logprobs=8,
    )
    kw = backend.llm.kwargs
    assert kw["model"] == "/m" and kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.3
    assert kw["dtype"] == "float32" and kw["max_model_len"] == 256 and kw["enforce_eager"] is True and kw["seed"] == 0
    assert kw["logprobs_mode"] == RAW_LOGPROBS and kw["max_logprobs"] == 8
    assert kw["weight_transfer_config"] == {"backend": "ipc"} and kw["worker_extension_cls"] == EXTENSION  # in-memory updates, checked
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"  # the IPC handles cross the engine core's msgpack pickled
    for owned in ("weight_transfer_config", "worker_extension_cls"):
        with pytest.raises(ValueError, match=f"'{owned}'.* set by the backend"):
            VLLMBackend.load("/m", **{owned: "x"})
    assert backend.tokenizer.padding_side == "left" and backend.version == 0 and backend.eos_id == EOS
    with pytest.raises(ValueError, match="raw_logprobs"):
        VLLMBackend.load("/m", logprobs_mode="processed_logprobs")


# ---------------------------------------------------------------------------- sampling parameters


def test_seeds_are_distinct_per_prompt_and_reproducible():
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, n=4, seed=3, stop=("\n\n",))
    seeds = [sampling_kwargs(params, i)["seed"] for i in range(50)]
    assert len(set(seeds)) == 50  # distinct prompts, distinct seeds
    assert seeds == [sampling_kwargs(params, i)["seed"] for i in range(50)]  # reproducible
    assert all(0 <= s < 2**31 - 1 for s in seeds)
    # vLLM seeds the n samples of a request seed+i: no two (prompt, sample) pairs share a seed
    assert len({s + i for s in seeds for i in range(params.n)}) == 50 * params.n
    other = [sampling_kwargs(params.model_copy(update={"seed": 4}), i)["seed"] for i in range(50)]
    assert set(other).isdisjoint(seeds)
    kw = sampling_kwargs(params, 0)
    assert kw["n"] == 4 and kw["max_tokens"] == 12 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["stop"] == ["\n\n"] and kw["include_stop_str_in_output"] is True
    assert kw["logprobs"] == 0  # the sampled token's log-prob only


def test_unseeded_and_greedy_mapping():
    kw = sampling_kwargs(SamplingParams(temperature=1.0), 0)
    assert "seed" not in kw and "stop" not in kw
    greedy = sampling_kwargs(SamplingParams(temperature=0.0, top_p=0.5, n=2, seed=1), 7)
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["n"] == 1 and "seed" in greedy
    FakeSamplingParams(**greedy)  # accepted by (the fake of) vLLM's validation


def test_score_sampling_kwargs():
    assert score_sampling_kwargs(("logprobs",), 0)["prompt_logprobs"] == 0
    kw = score_sampling_kwargs(("logprobs", "topk"), 5)
    assert kw["prompt_logprobs"] == 5 and kw["max_tokens"] == 1 and kw["n"] == 1


# ---------------------------------------------------------------------------- completions


def test_eos_is_kept_with_its_logprob_and_reason_stop():
    c = to_completion(completion_output([7, 8, EOS], [-0.5, -1.0, -0.25], text="ab"), prompt_index=2, sample_index=1, eos_id=EOS)
    assert isinstance(c, Completion)
    assert c.token_ids == [7, 8, EOS] and c.logprobs == [-0.5, -1.0, -0.25]
    assert (c.finish_reason, c.prompt_index, c.sample_index, c.text) == ("stop", 2, 1, "ab")


def test_length_and_stop_string_finishes():
    c = to_completion(completion_output([7, 8, 9], finish="length"), 0, 0, EOS)
    assert c.finish_reason == "length" and c.token_ids == [7, 8, 9] and len(c.logprobs) == 3
    s = to_completion(completion_output([7, 8], finish="stop", text="x\n\n"), 0, 0, EOS)  # stop string: no EOS
    assert s.finish_reason == "stop" and s.token_ids == [7, 8] and s.text == "x\n\n"
    with pytest.raises(RuntimeError, match="abort"):
        to_completion(completion_output([7], finish="abort"), 0, 0, EOS)


def test_anything_after_a_first_eos_is_cut():
    c = to_completion(completion_output([7, EOS, 8, 9], [-1.0, -2.0, -3.0, -4.0], finish="length"), 0, 0, EOS)
    assert c.token_ids == [7, EOS] and c.logprobs == [-1.0, -2.0] and c.finish_reason == "stop"


def test_logprob_extraction_picks_the_sampled_token_and_handles_missing_logprobs():
    out = completion_output([4, 5], [-0.3, -0.7])
    out.logprobs[0][3] = lp(-0.01, 1)  # a more likely, unsampled token in the same dict
    assert to_completion(out, 0, 0, EOS).logprobs == [-0.3, -0.7]
    assert to_completion(completion_output([4, 5], with_logprobs=False), 0, 0, EOS).logprobs == []
    broken = completion_output([4, 5])
    broken.logprobs[1] = {6: lp(-1.0)}
    with pytest.raises(ValueError, match="lack the sampled token 5"):
        to_completion(broken, 0, 0, EOS)


def test_request_outputs_are_ordered_by_index_and_counted():
    request = SimpleNamespace(outputs=[completion_output([3], index=1, finish="length"), completion_output([2], index=0, finish="length")])
    out = request_to_completions(request, prompt_index=4, n=2, eos_id=EOS)
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == [(4, 0, [2]), (4, 1, [3])]
    with pytest.raises(RuntimeError, match="asked for 3 samples"):
        request_to_completions(request, 4, 3, EOS)


# ---------------------------------------------------------------------------- prompt log-probs


def test_prompt_logprob_tensor_alignment_with_right_padding():
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0], [0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    entries = [
        [None, {6: lp(-0.6, 1)}, {7: lp(-0.7, 3), 1: lp(-0.1, 1), 2: lp(-0.2, 2)}, {8: lp(-0.8, 2), 3: lp(-0.3, 1)}],
        [None, {10: lp(-1.0, 1)}],
        [None],
        None,  # an empty row is not sent to vLLM
    ]
    out = prompt_logprobs_to_tensor(entries, input_ids, mask, ("logprobs",))
    assert set(out) == {"logprobs"} and out["logprobs"].shape == (4, 4) and out["logprobs"].dtype == torch.float32
    expected = [[0.0, -0.6, -0.7, -0.8], [0.0, -1.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    torch.testing.assert_close(out["logprobs"], torch.tensor(expected))


def test_prompt_logprob_tensor_left_padding_uses_the_mask():
    input_ids = torch.tensor([[0, 0, 9, 10]])
    out = prompt_logprobs_to_tensor([[None, {10: lp(-1.5)}]], input_ids, torch.tensor([[0, 0, 1, 1]]))
    torch.testing.assert_close(out["logprobs"], torch.tensor([[0.0, 0.0, 0.0, -1.5]]))


def test_topk_from_prompt_logprobs():
    # the actual token (7) is outside the top 2, so vLLM's dict has k + 1 entries
    entry = {7: lp(-2.0, 5), 1: lp(-0.1, 1), 2: lp(-0.2, 2)}
    assert topk_from_entry(entry, 2) == ([-0.1, -0.2], [1, 2])
    # the actual token inside the top k: exactly k entries
    assert topk_from_entry({3: lp(-0.5, 2), 4: lp(-0.4, 1)}, 2) == ([-0.4, -0.5], [4, 3])
    with pytest.raises(ValueError, match="3 prompt log-probs at a position, fewer than top_k=4"):
        topk_from_entry(entry, 4)
    input_ids, mask = torch.tensor([[5, 7, 0]]), torch.tensor([[1, 1, 0]])
    out = prompt_logprobs_to_tensor([[None, entry]], input_ids, mask, ("logprobs", "topk"), top_k=2)
    assert out["topk_logprobs"].shape == (1, 3, 2) and out["topk_ids"].dtype == torch.long
    assert out["topk_logprobs"][0, 1].tolist() == pytest.approx([-0.1, -0.2]) and out["topk_ids"][0, 1].tolist() == [1, 2]
    assert out["topk_logprobs"][0, 0].tolist() == [0.0, 0.0] and out["topk_ids"][0, 2].tolist() == [0, 0]
    assert out["logprobs"][0].tolist() == pytest.approx([0.0, -2.0, 0.0])


def test_prompt_logprob_mismatches_are_errors():
    with pytest.raises(ValueError, match="3 tokens but 2"):
        prompt_logprobs_to_tensor([[None, {6: lp(-1.0)}]], torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="lack the actual token 6"):
        prompt_logprobs_to_tensor([[None, {9: lp(-1.0)}]], torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))


def test_unsupported_score_fields_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="full distribution"):
        check_score_request(("logprobs", "entropy"), 0)
    with pytest.raises(NotImplementedError, match="hf backend"):
        check_score_request(("full",), 0)
    with pytest.raises(ValueError, match="unknown score fields"):
        check_score_request(("logits",), 0)
    with pytest.raises(ValueError, match="top_k >= 1"):
        check_score_request(("topk",), 0)
    with pytest.raises(ValueError, match="max_logprobs=20"):
        check_score_request(("topk",), 21, 20)
    check_score_request(("logprobs", "topk"), 20, 20)


# ---------------------------------------------------------------------------- the backend over a fake engine


@pytest.fixture
def fake_backend(monkeypatch):
    """A backend started by ``load`` on the fake engine, so the engine sees exactly the options the backend gives it."""
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(FakeLLM))
    monkeypatch.setattr(vllm_backend, "export_ipc", fake_export)  # CUDA IPC handles -> the stand-in's shared table
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)  # load() sets it; undone after the test
    return VLLMBackend.load("/m", max_logprobs=20)


def test_generate_is_one_call_prompt_major_with_per_prompt_seeds(fake_backend):
    prompts = [[10, 11], [20], [30, 31, 32]]
    params = SamplingParams(temperature=1.0, n=3, seed=0, max_new_tokens=5)
    out = fake_backend.generate(prompts, params)
    assert len(fake_backend.llm.calls) == 1
    sent_prompts, sent_params = fake_backend.llm.calls[0]
    assert [p["prompt_token_ids"] for p in sent_prompts] == prompts
    assert [sp["seed"] for sp in sent_params] == [sampling_kwargs(params, i)["seed"] for i in range(3)]
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(3)]
    assert [c.token_ids for c in out[:3]] == [[11, EOS], [12, EOS], [13, EOS]]
    assert all(c.finish_reason == "stop" and len(c.logprobs) == 2 and "generate_s" in c.timings for c in out)
    assert fake_backend.generate([], params) == []


def test_score_over_the_fake_engine(fake_backend):
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 0], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    out = fake_backend.score(input_ids, mask, want=("logprobs", "topk"), top_k=2)
    sent_prompts, sent_params = fake_backend.llm.calls[-1]
    assert [p["prompt_token_ids"] for p in sent_prompts] == [[5, 6, 7], [8, 9]]  # unpadded, empty row skipped
    assert all(sp["prompt_logprobs"] == 2 and sp["max_tokens"] == 1 and "allowed_token_ids" not in sp for sp in sent_params)
    torch.testing.assert_close(out["logprobs"], torch.tensor([[0.0, -0.6, -0.7], [0.0, -0.9, 0.0], [0.0, 0.0, 0.0]]))
    assert out["topk_ids"][0, 1].tolist() == [100, 101]
    with pytest.raises(NotImplementedError):
        fake_backend.score(input_ids, mask, want=("logprobs", "full"))
    with pytest.raises(NotImplementedError, match="gradients"):
        fake_backend.score(input_ids, mask, grad=True)


def test_the_fake_is_as_strict_as_vllm_sampling_params():
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy sampling"):
        FakeSamplingParams(n=2, temperature=0.0)
    with pytest.raises(VLLMValidationError, match=r"temperature must be in \[0, 2\]"):
        FakeSamplingParams(temperature=2.5)
    with pytest.raises(VLLMValidationError, match="empty string"):
        FakeSamplingParams(stop=["\n", ""])
    assert FakeSamplingParams(temperature=0.001)["temperature"] == 0.01  # vLLM's silent clamp


def test_the_fake_rpc_boundary_turns_tensors_into_lists_as_vllm_does():
    method, _, args, _ = utility_round_trip(["m", None, [[("w", torch.arange(6, dtype=torch.float32).reshape(3, 2))]], {}])
    name, encoded = args[0][0]
    assert method == "m" and name == "w" and isinstance(encoded, list) and encoded[:2] == ["float32", [3, 2]]
    assert torch.equal(
        torch.frombuffer(bytearray(encoded[2]), dtype=torch.float32).reshape(3, 2), torch.arange(6, dtype=torch.float32).reshape(3, 2)
    )
    with pytest.raises(TypeError, match="not serializable"):
        utility_round_trip(["m", None, [object()], {}])


def new_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    """An HF-named state dict (q/k/v split, lm_head tied) unlike the stand-in engine's initial weights."""
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) for k, v in hf_state(FakeModel()).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return state


def test_load_weights_updates_the_engine_in_memory_and_checks_it(fake_backend):
    state = new_weights()
    fake_backend.load_weights(state, version=7)
    llm, model = fake_backend.llm, fake_backend.llm.worker.get_model()
    assert [m for m, _, _ in llm.rpc] == [
        "harness_param_shapes", "harness_checksum", "init_weight_transfer_engine", "start_weight_update", "update_weights",
        "finish_weight_update", "harness_checksum",
    ]  # fmt: skip
    update_info = llm.rpc[4][2]["update_info"]
    assert update_info["names"] == list(state) and update_info["shapes"] == [list(t.shape) for t in state.values()]
    assert update_info["dtype_names"] == ["float32"] * len(state) and all(set(h) == {"fake-gpu-0"} for h in update_info["ipc_handles"])
    assert hf_state(model).keys() == state.keys() and all(torch.equal(hf_state(model)[k], v) for k, v in state.items())
    probe = llm.rpc[1][1][0]
    assert len(probe) == 4 and not any("q_proj" in n or "k_proj" in n or "v_proj" in n or n == "lm_head.weight" for n in probe)
    assert llm.prefix_resets == 1 and fake_backend.version == 7 and llm.weight_version == "7"
    assert fake_backend.loaded_checksum == checksum(state)  # what check_loaded compares with the learner's
    fake_backend.load_weights({k: v + 1 for k, v in state.items()}, version=8)
    methods = [m for m, _, _ in llm.rpc]
    assert methods.count("init_weight_transfer_engine") == 1 and methods.count("harness_param_shapes") == 1  # once per engine
    assert torch.equal(model.params["model.norm.weight"], state["model.norm.weight"] + 1) and fake_backend.version == 8


def test_the_rollout_compares_the_backends_loaded_checksum_with_the_learners(fake_backend):
    """check_loaded (what every rollout runs after load_weights) reads vLLM's loaded_checksum: a transport that altered the
    weights before they reached the backend is refused even though the engine took what it was handed."""
    from opd_harness.trainers.weight_sync import check_loaded

    state = new_weights()
    fake_backend.load_weights(state, version=2)
    check_loaded(fake_backend, checksum(state), 2)
    with pytest.raises(WeightSyncError, match="did not take weights version 2"):
        check_loaded(fake_backend, checksum({k: v * 2 for k, v in state.items()}), 2)


@pytest.mark.parametrize(("fault", "message"), [("stale", r"its weights did not change \(a stale load\)"), ("corrupt", "a corrupt load")])
def test_a_stale_or_corrupt_load_is_refused_and_nothing_is_bumped(fake_backend, fault, message):
    fake_backend.llm.worker.fault = fault
    with pytest.raises(WeightSyncError, match=f"engine worker 0 did not take weights version 3: .*{message}"):
        fake_backend.load_weights(new_weights(), version=3)
    assert fake_backend.version == 0 and fake_backend.loaded_checksum is None and fake_backend.llm.prefix_resets == 0


def test_every_tensor_parallel_worker_is_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(FakeLLM))
    monkeypatch.setattr(vllm_backend, "export_ipc", fake_export)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    backend = VLLMBackend.load("/m", tensor_parallel_size=2)
    backend.llm.workers[1].fault = "stale"
    with pytest.raises(WeightSyncError, match="engine worker 1 did not take weights version 1"):
        backend.load_weights(new_weights(), version=1)
    handles = backend.llm.rpc[-3][2]["update_info"]["ipc_handles"]
    assert all(set(h) == {"fake-gpu-0", "fake-gpu-1"} for h in handles)  # a copy on each of the engine's GPUs


def test_the_same_weights_sent_again_are_a_valid_load():
    assert check_engine_load(["a1", "a1"], ["a1", "a1"], "a1", 4) is None  # unchanged, and equal to what was sent
    with pytest.raises(WeightSyncError, match="2 workers answered before the update, 1 after"):
        check_engine_load(["a1", "a1"], ["a1"], "a1", 4)


def test_a_model_whose_names_all_differ_from_the_state_dict_cannot_be_checked_and_is_refused():
    state = {"q_proj.weight": torch.ones(2, 2), "norm.weight": torch.ones(2)}
    assert probe_names(state, [{"qkv.weight": [6, 2], "norm.weight": [2]}] * 2) == ["norm.weight"]
    with pytest.raises(WeightSyncError, match="cannot check weight updates"):
        probe_names(state, [{"norm.weight": [2]}, {"norm.weight": [1]}])  # sharded on worker 1: not a full copy anywhere else
    with pytest.raises(WeightSyncError, match="cannot check weight updates"):
        probe_names(state, [{"model.language_model.norm.weight": [2]}])


def test_a_failed_prefix_cache_reset_is_an_error(fake_backend):
    fake_backend.llm.prefix_reset_result = False
    with pytest.raises(RuntimeError, match="reset_prefix_cache"):
        fake_backend.load_weights(new_weights(), version=1)
    assert fake_backend.version == 0


def test_greedy_with_n_samples_sends_one_and_copies_it(fake_backend):
    out = fake_backend.generate([[10, 11], [20]], SamplingParams(temperature=0.0, n=3, max_new_tokens=4))
    _, sent = fake_backend.llm.calls[-1]
    assert [sp["n"] for sp in sent] == [1, 1]
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(2) for s in range(3)]
    assert [c.token_ids for c in out] == [[11, EOS]] * 3 + [[20, EOS]] * 3
    out[0].token_ids.append(99)  # copies, not one shared list
    assert out[1].token_ids == [11, EOS]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=2.5), "above vLLM's limit of 2.0"),
        (SamplingParams(temperature=0.005), "silently raises to 0.01"),
        (SamplingParams(stop=("\n\n", "")), "empty stop string"),
    ],
)
def test_what_vllm_refuses_is_refused_first_with_a_clear_error(fake_backend, params, message):
    with pytest.raises(ValueError, match=message):
        fake_backend.generate([[10, 11]], params)
    assert fake_backend.llm.calls == []  # nothing was sent
    assert len(fake_backend.generate([[10, 11]], SamplingParams(temperature=2.0, stop=("x",)))) == 1  # the limit itself is allowed


def test_a_row_of_exactly_max_model_len_is_scored(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(FakeLLM))
    backend = VLLMBackend(FakeLLM(max_model_len=4), max_logprobs=20)
    input_ids = torch.tensor([[5, 6, 7, 8], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = backend.score(input_ids, mask, want=("logprobs", "topk"), top_k=2)
    sent_prompts, sent_params = backend.llm.calls[-1]
    assert [p["prompt_token_ids"] for p in sent_prompts] == [[5, 6, 7], [8, 9]]
    assert sent_params[0]["allowed_token_ids"] == [8] and sent_params[0]["logprobs"] == 2 and "allowed_token_ids" not in sent_params[1]
    torch.testing.assert_close(out["logprobs"], torch.tensor([[0.0, -0.6, -0.7, -0.8], [0.0, -0.9, 0.0, 0.0]]))
    assert out["topk_ids"][0, 3].tolist() == [100, 101]
    with pytest.raises(ValueError, match="row 0 has 5 tokens, more than the engine's max_model_len=4"):
        backend.score(torch.tensor([[5, 6, 7, 8, 9]]), torch.ones(1, 5, dtype=torch.long))


def test_the_mismatched_stand_in_engine_scores_and_samples_off_the_trainer_and_takes_weights(monkeypatch, tmp_path):
    """The stand-in engine of the π_old tests (test_importance_ratios.py): log-probs 1.1 × the trainer's, weights through load_weights."""
    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, save_model_and_tokenizer

    tok = build_char_tokenizer()
    arch = TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64)
    models = [build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=seed) for seed in (0, 1)]
    save_model_and_tokenizer(models[0], tok, tmp_path / "m")
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(HFEngineLLM))
    monkeypatch.setattr(vllm_backend, "export_ipc", fake_export)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    engine = VLLMBackend.load(str(tmp_path / "m"))
    ids = torch.tensor([tok("12+7=19", add_special_tokens=False)["input_ids"]])
    for model, version in zip(models, (0, 3)):
        if version:
            engine.load_weights(models[1].state_dict(), version)
        trainer = HFBackend(model, tok).score(ids, torch.ones_like(ids))["logprobs"]
        torch.testing.assert_close(engine.score(ids, torch.ones_like(ids))["logprobs"], trainer * ENGINE_LOGPROB_SCALE)
    sample = engine.generate([ids[0].tolist()], SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))[0]
    full = torch.tensor([ids[0].tolist() + sample.token_ids])
    rescored = HFBackend(models[1], tok).score(full, torch.ones_like(full))["logprobs"][0, ids.shape[1] :]
    assert sample.logprobs == pytest.approx((rescored * ENGINE_LOGPROB_SCALE).tolist(), abs=1e-4)
    engine.close()


# ---------------------------------------------------------------------------- GPU: the real engine against HF


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (install the gpu extra in a separate environment; see DEVELOPERS.md)"
    return None


_SKIP = _gpu_skip_reason()

# float32 so that log-probs match HF within 1e-2; VLLM_TEST_DTYPE=bfloat16 tries another dtype (tolerances may then fail)
TEST_DTYPE = os.environ.get("VLLM_TEST_DTYPE", "float32")
NORM_SCALE = 4.0  # sharpen the random tiny model: greedy margins well above float noise, sampling still varied


def _tiny(seed: int):
    from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    # head_dim 64: supported by every vLLM attention backend
    arch = TinyArch(hidden=128, layers=2, heads=2, kv_heads=1, ffn=256, max_positions=512)
    model = build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
    return model, tok


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    if _SKIP is not None:
        pytest.skip(_SKIP)
    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import save_model_and_tokenizer

    model, tok = _tiny(seed=0)
    path = tmp_path_factory.mktemp("tiny_vllm") / "model"
    save_model_and_tokenizer(model, tok, path)
    vllm_backend = VLLMBackend.load(str(path), dtype=TEST_DTYPE, gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True, seed=0)
    hf = HFBackend(model.float(), tok, batch_size=16, device="cuda")
    yield vllm_backend, hf, tok
    vllm_backend.close()


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


PROMPTS = ["Compute 12+7.\n", "Hi", "The answer is \\boxed{", "3*4="]


def _right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@pytest.mark.gpu
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_gpu_n_samples_per_prompt_seeded_and_eos(engines):
    vb, _, tok = engines
    prompts = [_encode(tok, p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=4, seed=123)
    out = vb.generate(prompts, params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(len(prompts)) for s in range(4)]
    for c in out:
        assert len(c.logprobs) == len(c.token_ids) > 0 and all(x <= 0.0 for x in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 24
    again = vb.generate(prompts, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # seeded: reproducible
    assert len({tuple(c.token_ids) for c in out}) > len(prompts)  # samples differ within prompts
    # the same prompt twice still gets different samples (per-prompt seeds)
    twice = vb.generate([prompts[0], prompts[0]], SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=5))
    assert [c.token_ids for c in twice[:2]] != [c.token_ids for c in twice[2:]]


@pytest.mark.gpu
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_gpu_sampled_logprobs_match_hf_score(engines):
    vb, hf, tok = engines
    prompts = [_encode(tok, p) for p in PROMPTS]
    # temperature 0.7 and top_p 0.9: the returned log-probs must still be the *untempered* ones
    out = vb.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20, n=3, seed=0))
    for c in out:
        prompt = prompts[c.prompt_index]
        ids = torch.tensor([prompt + c.token_ids])
        scored = hf.score(ids, torch.ones_like(ids))["logprobs"][0, len(prompt) :].cpu()
        assert scored.tolist() == pytest.approx(c.logprobs, abs=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_gpu_greedy_equals_hf_greedy(engines):
    vb, hf, tok = engines
    prompts = [_encode(tok, p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    ours = vb.generate(prompts, greedy)
    theirs = hf.generate(prompts, greedy)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids, (a.prompt_index, a.token_ids, b.token_ids)
        assert a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_gpu_score_matches_hf_score(engines):
    vb, hf, tok = engines
    seqs = [_encode(tok, t) for t in ("Compute 12+7.\n12+7=19\n\\boxed{19}", "Hi there", "x", "3*4=12")]
    ids, mask = _right_pad(seqs, tok.pad_token_id)
    ours = vb.score(ids, mask, want=("logprobs", "topk"), top_k=5)
    theirs = hf.score(ids, mask, want=("logprobs", "topk"), top_k=5)
    theirs = {k: v.cpu() for k, v in theirs.items()}
    valid = mask.bool().clone()
    valid[:, 0] = False
    assert ours["logprobs"].shape == ids.shape
    assert torch.allclose(ours["logprobs"][valid], theirs["logprobs"][valid], atol=1e-2)
    assert (ours["logprobs"][~valid] == 0).all()
    assert torch.allclose(ours["topk_logprobs"][valid], theirs["topk_logprobs"][valid], atol=1e-2)
    # ids may differ only between near-tied tokens: HF's log-prob of each of our top-k ids matches our value
    full = hf.score(ids, mask, want=("full",))["full"].cpu()
    looked_up = full.gather(-1, ours["topk_ids"])
    assert torch.allclose(looked_up[valid], ours["topk_logprobs"][valid], atol=1e-2)
    with pytest.raises(NotImplementedError):
        vb.score(ids, mask, want=("entropy",))


@pytest.mark.gpu
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_gpu_a_row_of_exactly_max_model_len_matches_hf(engines):
    vb, hf, tok = engines
    limit = vb.max_model_len()
    text = "Compute 12+7.\n12+7=19\n" * 40
    seqs = [_encode(tok, text)[:limit], _encode(tok, "Hi there")]
    assert len(seqs[0]) == limit
    ids, mask = _right_pad(seqs, tok.pad_token_id)
    ours = vb.score(ids, mask, want=("logprobs", "topk"), top_k=5)
    theirs = {k: v.cpu() for k, v in hf.score(ids, mask, want=("logprobs", "topk"), top_k=5).items()}
    valid = mask.bool().clone()
    valid[:, 0] = False
    assert torch.allclose(ours["logprobs"][valid], theirs["logprobs"][valid], atol=1e-2)
    assert torch.allclose(ours["topk_logprobs"][0, limit - 1], theirs["topk_logprobs"][0, limit - 1], atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_gpu_load_weights_swaps_the_policy(engines):
    """Runs last in this module: loads other weights, checks them, then restores the originals."""
    vb, hf, tok = engines
    other, _ = _tiny(seed=1)
    seqs = [_encode(tok, t) for t in ("Compute 1+2.\n3", "Hello")]
    ids, mask = _right_pad(seqs, tok.pad_token_id)
    valid = mask.bool().clone()
    valid[:, 0] = False
    original = {k: v.detach().cpu().clone() for k, v in hf.model.state_dict().items()}
    try:
        vb.load_weights(other.state_dict(), version=3)
        assert vb.version == 3
        from opd_harness.backends.hf import HFBackend

        expected = HFBackend(other.float(), tok, device="cuda").score(ids, mask)["logprobs"].cpu()
        assert torch.allclose(vb.score(ids, mask)["logprobs"][valid], expected[valid], atol=1e-2)
    finally:
        vb.load_weights(original, version=0)
    restored = hf.score(ids, mask)["logprobs"].cpu()
    assert torch.allclose(vb.score(ids, mask)["logprobs"][valid], restored[valid], atol=1e-2)
