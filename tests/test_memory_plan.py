"""The memory plan (``harness run --dry-run``): shapes from configs, the terms, the CLI's exit codes and output."""

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from opd_harness.teacher_signal import bytes_per_token
from opd_harness.memory_plan import (
    ModelShape,
    describe_shape,
    kv_cache_bytes,
    layer_activation_bytes_per_token,
    learner_state_terms,
    mlp_width,
    model_shape,
    parameter_count,
    published_shape,
    shape_from_config,
)
from opd_harness.models.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layouts" / "f-opd-16xh100.yaml"
runner = CliRunner()


@pytest.fixture(autouse=True)
def benchmark_rows(tmp_path, monkeypatch) -> None:
    """--dry-run loads every task's data first: one local row per benchmark the shipped layout names stands for it (the
    plan reads no more), each in its real file's format (MATH-500 and AIME 2024 JSONL, DAPO-Math-17k's verl parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    math500 = {"problem": "What is 1+1?", "solution": "2", "answer": "2", "subject": "Algebra", "level": 1, "unique_id": "t/1.json"}
    aime24 = {"id": 60, "problem": "What is 2+2?", "solution": "4", "answer": "004", "url": "https://example.org/1",
              "question": "What is 2+2?"}  # fmt: skip
    dapo = {"data_source": "DAPO-17k", "prompt": [{"content": "What is 3+3?", "role": "user"}], "ability": "math",
            "reward_model": {"ground_truth": "6", "style": "rule"}, "extra_info": {"answer": "", "index": 0, "split": "train"}}  # fmt: skip
    for task, row in (("math500", math500), ("aime24", aime24)):
        (data / task).mkdir(parents=True)
        (data / task / "test.jsonl").write_text(json.dumps(row) + "\n")
    (data / "dapo_math").mkdir()
    pq.write_table(pa.Table.from_pylist([dapo]), data / "dapo_math" / "dapo_math_17k.parquet")
    monkeypatch.setenv("HARNESS_DATA_DIR", str(data))


def dry_run(*args: str, sets: list[str] = ()):
    return runner.invoke(app, ["run", *args, *(a for s in sets for a in ("--set", s)), "--dry-run"])


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_counts_from_the_shape_match_the_model_cards(name):
    counted = parameter_count(published_shape(name))
    assert abs(counted - SHAPES[name].published_params) / SHAPES[name].published_params < 0.03, counted


def test_parameter_count_equals_an_instantiated_model(tmp_path):
    from opd_harness.models.tiny import TinyArch, build_tiny_model

    arch = TinyArch(hidden=32, layers=3, heads=4, kv_heads=2, ffn=80)
    model = build_tiny_model(arch, 1000, pad_id=0, eos_id=1, seed=0)
    model.config.save_pretrained(tmp_path)  # the folder's config.json only: the plan reads no weights
    spec = build_config(overrides=[f"student.path={tmp_path}", "student.sft_steps=0"]).student
    shape = model_shape(spec, "student")
    assert parameter_count(shape) == sum(p.numel() for p in model.parameters())
    assert (shape.vocab, shape.layers, shape.kv_heads, shape.head_dim) == (1000, 3, 2, 8)


def meta_parameters(config) -> int:
    """Parameters of ``Qwen3MoeForCausalLM(config)`` built on the meta device (no memory), tied embeddings counted once."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3MoeForCausalLM(config).parameters())


def folder_shape(config, folder: Path) -> ModelShape:
    """The plan's shape of a model folder holding only ``config``'s config.json (the plan reads no weights)."""
    config.save_pretrained(folder)
    return model_shape(build_config(overrides=[f"student.path={folder}", "student.sft_steps=0"]).student, "student")


def test_a_qwen3_moe_config_counts_every_expert_and_router_like_transformers(tmp_path):
    """Sparse and dense layers mixed as transformers decides (decoder_sparse_step 2, layer 3 in mlp_only_layers: only
    layer 1 is sparse), untied: the count from config.json equals the model transformers builds from it."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=1000, hidden_size=32, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                            decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=False)  # fmt: skip
    shape = folder_shape(config, tmp_path)
    assert (shape.moe_layers, shape.experts, shape.experts_per_token, shape.expert_intermediate) == (1, 6, 2, 24)
    assert parameter_count(shape) == meta_parameters(config)
    hub_style = {("num_experts" if k == "num_local_experts" else k): v for k, v in config.to_dict().items()}  # the hub's spelling
    assert shape_from_config(hub_style, "m", "hub config.json") == replace(shape, name="m", source="hub config.json")
    assert mlp_width(shape) == 80  # the dense layers' 80 is wider than 2 routed experts of 24


def test_qwen3_30b_a3b_from_its_config_json_is_planned_with_every_expert(tmp_path):
    """The config.json an online plan reads for Qwen/Qwen3-30B-A3B(-Instruct-2507) carries an intermediate_size (6144)
    that no layer uses: counted from it, the model had 3.3B parameters; with its 128 experts it has 30.5B, as
    transformers builds it, and a token's forward goes through 8 experts of 768."""
    from transformers import AutoConfig

    from opd_harness.models.shapes import shape_config

    shape = folder_shape(shape_config("qwen3-30b-a3b-shape"), tmp_path)
    assert parameter_count(shape) == meta_parameters(AutoConfig.from_pretrained(tmp_path)) == 30_532_122_624
    assert "30.5B parameters, 3.35B active per token (128 experts of 768, 8 per token, in 48 of 48 layers)" in describe_shape(shape)
    assert mlp_width(shape) == 8 * 768


def test_moe_activations_grow_with_the_routed_experts_not_with_all_of_them():
    """A sparse layer keeps per token what its experts_per_token experts compute (and the router's E probabilities),
    so doubling the experts adds only router bytes and doubling the routed ones adds expert bytes."""
    shape = published_shape("qwen3-30b-a3b-shape")
    base = layer_activation_bytes_per_token(shape, 2)
    more_experts = layer_activation_bytes_per_token(replace(shape, experts=256), 2)
    more_routed = layer_activation_bytes_per_token(replace(shape, experts_per_token=16), 2)
    assert more_experts - base == 128 * 4  # the router's float32 probabilities over 128 more experts
    assert more_routed - base == 8 * ((3 * 2048 + 4 * 768 + 2) * 2 + 24)
    assert base > layer_activation_bytes_per_token(shape, 2, sparse=False)  # more than a dense MLP of the unused 6144 would keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sparse_mlp_term_is_what_transformers_saves_for_the_backward(dtype):
    """transformers' Qwen3MoeSparseMoeBlock (16 experts, 4 per token) on 256 tokens: the distinct non-weight tensors
    autograd saves, less the block's input (the layer term counts it as the norm's output), are the plan's per-token
    sparse MLP term within 1 % (the int64 indices per expert vary with the routing)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from opd_harness.memory_plan import mlp_activation_bytes_per_token

    config = Qwen3MoeConfig(hidden_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to(dtype)
    for weight in block.parameters():  # the experts start as torch.empty
        torch.nn.init.normal_(weight, std=0.02)
    weights = {w.untyped_storage().data_ptr() for w in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = 256
    x = torch.randn(1, tokens, 128, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).float().sum().backward()
    measured = (sum(saved.values()) - x.numel() * x.element_size()) / tokens
    shape = ModelShape("m", "test", 1, 128, 4, 2, 32, 0, 1000, False, 16, 4, 48, 1)
    planned = mlp_activation_bytes_per_token(shape, x.element_size(), sparse=True)
    assert abs(planned - measured) / measured < 0.01, (planned, measured)


def test_a_mixture_of_experts_layout_the_plan_does_not_model_is_refused_naming_the_key(tmp_path):
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    with pytest.raises(ConfigError, match=r"student\.path=.*num_local_experts but no moe_intermediate_size \(Mixtral-style"):
        folder_shape(config, tmp_path)


def test_teacher_signal_and_kv_cache_sizes():
    assert bytes_per_token("sampled", hidden=4096, top_k=20, dtype_bytes=4) == 4
    assert bytes_per_token("topk", hidden=4096, top_k=20, dtype_bytes=4) == 20 * 12 + 4
    assert bytes_per_token("student_topk", hidden=4096, top_k=5, dtype_bytes=2) == 5 * 12 + 4
    assert bytes_per_token("full", hidden=4096, top_k=20, dtype_bytes=2) == 4 + 8192
    with pytest.raises(ValueError, match="unknown teacher signal"):
        bytes_per_token("logits", hidden=4096, top_k=20, dtype_bytes=4)
    shape = published_shape("qwen3-8b-shape")  # 36 layers × 8 kv heads × 128: 144 KiB per token in bf16
    assert kv_cache_bytes(shape, rows=1, tokens=1, dtype_bytes=2) == 2 * 36 * 8 * 128 * 2


def test_fsdp2_divides_the_learner_state_by_the_ranks():
    shape = published_shape("qwen3-8b-shape")
    ddp = learner_state_terms(shape, ranks=4, sharding="ddp", precision="fp32")
    fsdp = learner_state_terms(shape, ranks=4, sharding="fsdp2", precision="fp32")
    assert ddp["optimizer"][0] == 8 * parameter_count(shape) and fsdp["optimizer"][0] == ddp["optimizer"][0] // 4
    assert ddp["weights"][0] // 4 < fsdp["weights"][0] < ddp["weights"][0] // 2  # a quarter plus one gathered layer


def test_shipped_16xh100_layout_plans_on_a_cpu_host():
    result = dry_run("--config", str(LAYOUT))
    assert result.exit_code == 0, result.output
    # the paper's training prompts, and evaluation on problems it does not train on
    assert "data: retool:dapo_math [train] 1 problems, retool:aime24 [test] 1 problems, retool:math500 [test]" in result.stdout
    for role in ("learner", "rollout", "teacher"):
        assert role in result.stdout
    assert "Qwen/Qwen3-8B: not in the hub cache; the published shape qwen3-8b-shape" in result.stdout
    if not torch.cuda.is_available():
        assert "capacity unknown" in result.stdout


def test_shipped_16xh100_layout_on_80gib():
    """Every role of the shipped layout fits: the learner's backward runs per forward_tokens bucket, so a rank holds one
    16,384-token row's activations, not its 64 rows', and its output head runs 1,024 positions at a time. With one graph
    over the step it needs ~247 GiB."""
    shipped = dry_run("--config", str(LAYOUT), "--device-memory", "80")
    assert shipped.exit_code == 0, shipped.output
    assert "DOES NOT FIT" not in shipped.stdout and shipped.stdout.count("fits") == 3  # learner, rollout and teacher devices
    one_graph = dry_run("--config", str(LAYOUT), "--device-memory", "80", sets=["trainer.bucket_backward=false"])
    assert one_graph.exit_code == 2
    line = one_graph.stderr.strip()
    assert "\n" not in line and "learner on gpu (learner) needs ~" in line and "largest term: activations (layers)" in line, line
    needs = float(line.partition("needs ~")[2].partition(" GiB")[0])
    assert needs > 200, line  # 64 rows × 16,384 tokens in one graph, checkpointed
    unchunked = dry_run("--config", str(LAYOUT), "--device-memory", "80", sets=["trainer.vocab_chunk=0"])
    assert unchunked.exit_code == 0  # one bucket's (16,384, V) float32 logits (37 GiB) still fit beside the rest
    assert "37.09" in unchunked.stdout and "5.92" in shipped.stdout  # activations (vocab): whole row vs chunks of 1,024


def test_an_8b_student_on_one_24gib_device_exits_2_naming_the_learner():
    result = dry_run("--method", "opd", "--task", "arith", "--device-memory", "24",
                     sets=["student.arch=qwen3-8b-shape", "student.sft_steps=0", "trainer.device=cuda"])  # fmt: skip
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("error: memory plan: learner (with rollout, teacher) on cuda"), line
    assert "GiB of 24.0 GiB; largest term: optimizer 61.0 GiB" in line, line  # activations are one bucket's (2,048 tokens)
    checkpointed = dry_run("--method", "opd", "--task", "arith", "--device-memory", "24", "--json",
                           sets=["student.arch=qwen3-8b-shape", "student.sft_steps=0", "trainer.device=cuda",
                                 "trainer.activation_checkpointing=true", "trainer.prompts_per_step=1"])  # fmt: skip
    assert checkpointed.exit_code == 2  # the state alone: 8.19B params × (4 + 4 + 8) bytes = 122 GiB
    assert "largest term: optimizer 61.0 GiB" in checkpointed.stderr, checkpointed.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only host refuses")
def test_planning_lets_a_cuda_device_through_but_a_run_still_refuses_it():
    with pytest.raises(ConfigError, match="trainer.device='cuda': torch sees no CUDA device"):
        build_config(overrides=["trainer.device=cuda"])
    assert build_config(overrides=["trainer.device=cuda"], planning=True).trainer.device == "cuda"
    with pytest.raises(ConfigError, match="choose cpu, cuda, cuda:N or auto"):
        build_config(overrides=["trainer.device=tpu"], planning=True)
    printed = runner.invoke(app, ["run", "--set", "trainer.device=cuda:1", "--print-config"])
    assert printed.exit_code == 0 and "device: cuda:1" in printed.stdout, printed.output


def test_json_totals_are_the_sum_of_their_terms_and_nothing_is_written(tmp_path):
    out = tmp_path / "results"
    result = dry_run("--config", str(LAYOUT), "--device-memory", "80", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["memory"]
    assert {d["name"] for d in plan["devices"]} >= {"gpu (learner)", "gpu (rollout)", "gpu (teacher)"}
    for device in plan["devices"]:
        terms = [t["bytes"] for t in plan["terms"] if t["device"] == device["name"]]
        assert terms and device["total_bytes"] == sum(terms) > 0
    learner = next(d for d in plan["devices"] if d["name"] == "gpu (learner)")
    assert learner["capacity"] == 80 * 1024**3 and learner["replicas"] == 4 and learner["fits"] is True
    assert not out.exists()


def test_dry_run_flags_are_checked():
    only = runner.invoke(app, ["run", "--device-memory", "24"])
    assert only.exit_code == 2 and "--device-memory is used only with --dry-run" in only.stderr
    bad = runner.invoke(app, ["run", "--dry-run", "--device-memory", "0"])
    assert bad.exit_code == 2 and "--device-memory" in bad.stderr


@pytest.mark.parametrize(
    ("env", "says"),
    [({"HF_HUB_OFFLINE": "1"}, "the hub is offline (HF_HUB_OFFLINE)"),
     ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub (http://127.0.0.1:9) is not reachable from here")],  # the discard port: refused
)  # fmt: skip
def test_an_unknown_hub_id_without_the_hub_fails_fast_naming_the_key(tmp_path, env, says):
    args = ["run", "--set", "student.path=nobody/no-such-model", "--set", "student.sft_steps=0", "--dry-run"]
    code = ("import sys; from typer.testing import CliRunner; from opd_harness.cli import app; "
            f"r = CliRunner().invoke(app, {args!r}); sys.stderr.write(r.stderr); sys.exit(r.exit_code)")  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", **env}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--student nobody/no-such-model: not in the hub cache and {says}" in " ".join(done.stderr.split())  # the models step
    assert time.monotonic() - started < 30  # imports included; huggingface_hub's own retries alone took ~25 s here


def test_a_tiny_shape_has_the_character_vocabulary():
    shape = model_shape(build_config(preset="smoke").student, "student")
    assert isinstance(shape, ModelShape) and shape.tied and 90 < shape.vocab < 110


@pytest.mark.slow
def test_one_measured_shape_is_within_25_percent():
    """The smallest shape of benchmarks/memory_plan_check.py: estimate vs the peak RSS of one learner step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_plan_check import run_case

    result = run_case("A")
    assert 0.75 <= result["ratio"] <= 1.25, result
