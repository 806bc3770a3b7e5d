"""A teacher on another backend (``teacher.backend``): config errors, top-k teacher distributions for the
``full`` estimator, and teacher failures that stop a step instead of training on missing log-probs."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from typer.testing import CliRunner

from batches import make_batch
from opd_harness.cli import app
from opd_harness.config import ConfigError, build_config
from opd_harness.errors import TrainingAborted
from opd_harness.method import StudentOutputs
from opd_harness.plan import plan_run
from opd_harness.teacher_signal import TAIL_FLOOR, TopKDistribution, apply_terms
from opd_harness.trainers.objectives.opd import OPDParams, full_reverse_kl, opd_objective
from opd_harness.trainers.teacher import TeacherFailed, score_teacher

runner = CliRunner()
SERVED = ["teacher.backend=openai", "teacher.base_url=http://127.0.0.1:9/v1"]


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["teacher.backend=openai"], "backend=openai needs the teacher server's address: set teacher.base_url="),
        (["teacher.backend=replay"], "backend: 'replay' cannot score sequences, so it cannot be a teacher"),
        (["teacher.backend=nope"], "teacher: Value error, backend: unknown backends 'nope'"),
        (["teacher.base_url=http://h/v1"], "base_url is used only with teacher.backend=openai"),
        (["teacher.backend=vllm"], "backend='vllm' loads the teacher's model folder: set teacher.path"),
        ([*SERVED, "teacher.backend_options.timeout=3"], "backend_options: ['timeout'] are not options of the openai backend"),
        ([*SERVED, "teacher.top_k=0"], "teacher.top_k"),
        ([*SERVED, "method=eopd"], "teacher.backend=openai: method 'eopd' reads the teacher's distribution as one of ['full']"),
    ],
)  # fmt: skip
def test_bad_teacher_config_exits_2_naming_the_flag_before_writing_anything(tmp_path, overrides, says):
    out = tmp_path / "out"
    args = [a for o in overrides if not o.startswith("method=") for a in ("--set", o)]
    args += [a for o in overrides if o.startswith("method=") for a in ("--method", o.removeprefix("method="))]
    result = runner.invoke(app, ["run", "--preset", "smoke", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())
    assert not out.exists()


def test_a_preset_tiny_teacher_gives_way_to_a_served_one():
    cfg = build_config(preset="smoke", overrides=SERVED)
    assert (cfg.teacher.arch, cfg.teacher.sft_steps, cfg.teacher.backend) == (None, 0, "openai")
    assert build_config(preset="smoke").teacher.arch is not None  # the in-process default is untouched


def test_served_teacher_switches_the_full_signal_to_topk_and_records_it():
    plan = plan_run(build_config(preset="smoke", overrides=[*SERVED, "teacher.top_k=7"]))
    assert plan.hparams.estimator == "full" and plan.config.teacher.signal == "topk"
    assert any("teacher.signal=topk" in w and "k = teacher.top_k = 7" in w for w in plan.warnings)
    assert plan_run(build_config(preset="smoke")).config.teacher.signal == "full"


@pytest.mark.parametrize(("overrides", "says"), [
    ([*SERVED, "teacher.signal=full"], "teacher.signal=full: teacher.backend=openai cannot give it"),
    (["teacher.signal=topk", "method_args.opd.estimator=sampled"], "accepts ['sampled']"),
    (["teacher.signal=student_topk", "trainer.rollout_backend=vllm"], "trainer.rollout_backend=vllm returns no top-k token ids"),
])  # fmt: skip
def test_a_teacher_signal_the_method_or_backend_cannot_use_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        plan_run(build_config(preset="smoke", overrides=overrides))


# ----------------------------------------------------------------------------- the top-k estimator


def topk_kl(student: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The reverse KL between the top-k signal's coarse-grained distributions."""
    return apply_terms(full_reverse_kl, student, TopKDistribution(ids, values))


def test_topk_reverse_kl_is_a_lower_bound_equal_to_the_full_kl_when_k_covers_the_vocabulary():
    torch.manual_seed(0)
    student = torch.log_softmax(torch.randn(2, 3, 10, dtype=torch.float64), -1).requires_grad_(True)
    teacher = torch.log_softmax(2 * torch.randn(2, 3, 10, dtype=torch.float64), -1)
    full = full_reverse_kl(student, teacher)
    previous = torch.zeros_like(full)
    # where k covers the vocabulary the teacher's tail bucket is floored at TAIL_FLOOR, so its buckets total 1 + TAIL_FLOOR
    # and the KL against them, renormalised (full_reverse_kl's mass term), exceeds the full KL by log(1 + TAIL_FLOOR)
    slack = TAIL_FLOOR + 1e-13
    for k in (1, 3, 6, 9, 10):
        values, ids = teacher.topk(k, -1)
        kl = topk_kl(student, ids, values)
        (grad,) = torch.autograd.grad(kl.sum(), student)
        assert torch.isfinite(grad).all()
        assert (kl <= full + slack).all() and (kl >= previous - 1e-12).all()  # coarser buckets lose information
        previous = kl.detach()
    assert torch.allclose(previous, full.detach(), rtol=0, atol=slack)


def test_topk_reverse_kl_by_hand():
    # teacher top-1 = token 0 (p 0.5); rest bucket 0.5. Student: 0.2 on token 0, 0.8 outside.
    student = torch.tensor([[[0.2, 0.3, 0.5]]]).log()
    kl = topk_kl(student, torch.tensor([[[0]]]), torch.tensor([[[math.log(0.5)]]]))
    assert kl.item() == pytest.approx(0.2 * math.log(0.2 / 0.5) + 0.8 * math.log(0.8 / 0.5), abs=1e-6)


def test_opd_full_estimator_reads_a_topk_signal():
    torch.manual_seed(1)
    teacher = torch.log_softmax(torch.randn(1, 2, 6), -1)
    logits = torch.randn(1, 2, 6, requires_grad=True)
    student = torch.log_softmax(logits, -1)
    batch = make_batch([[1, 1]], [[0.0, 0.0]], [[0.0, 0.0]], teacher_dist=teacher)
    exact, _ = opd_objective(batch, StudentOutputs(student[..., 0], full=student), OPDParams(estimator="full"))
    values, ids = teacher.topk(6, -1)
    batch.teacher_dist = TopKDistribution(ids, values)  # only top-k, as a served teacher gives
    covered, _ = opd_objective(batch, StudentOutputs(student[..., 0], full=student), OPDParams(estimator="full"))
    assert covered.item() == pytest.approx(exact.item(), abs=1e-6)
    values, ids = teacher.topk(2, -1)
    batch.teacher_dist = TopKDistribution(ids, values)
    coarse, _ = opd_objective(batch, StudentOutputs(student[..., 0], full=student), OPDParams(estimator="full"))
    assert coarse.item() < exact.item()
    with pytest.raises(ValueError, match="needs full student and teacher distributions"):
        only_student = StudentOutputs(student[:, :1, 0], full=student[:, :1])
        opd_objective(make_batch([[1]], [[0.0]], [[0.0]]), only_student, OPDParams(estimator="full"))


# ----------------------------------------------------------------------------- teacher failures


class FlakyTeacher:
    """Fails (or answers NaN) the first ``failures`` calls, then scores every token at -1."""

    def __init__(self, failures: int, *, nan: bool = False) -> None:
        self.failures, self.nan, self.calls = failures, nan, 0

    def score(self, input_ids, attention_mask, want=("logprobs",), top_k=0):
        self.calls += 1
        if self.calls <= self.failures and not self.nan:
            raise ConnectionError("teacher server went away")
        value = float("nan") if self.calls <= self.failures else -1.0
        return {"logprobs": torch.full(input_ids.shape, value)}


@pytest.fixture
def no_sleep(monkeypatch):
    monkeypatch.setattr("opd_harness.trainers.teacher.time.sleep", lambda s: None)


def test_a_failed_teacher_call_is_retried_and_then_fills_the_batch(no_sleep):
    batch = make_batch([[1, 1, 0]], [[0.0] * 3], [[0.0] * 3])
    teacher = FlakyTeacher(failures=1)
    score_teacher(teacher, batch, retries=1, step=3)
    assert teacher.calls == 2 and batch.teacher_logprobs.tolist() == [[-1.0, -1.0, 0.0]]


@pytest.mark.parametrize("nan", [False, True])
def test_a_teacher_that_keeps_failing_stops_the_step_untrained(no_sleep, nan):
    batch = make_batch([[1, 1]], [[0.0] * 2], [[0.0] * 2])
    before = batch.teacher_logprobs.clone()
    teacher = FlakyTeacher(failures=5, nan=nan)
    with pytest.raises(TeacherFailed, match="teacher scoring of step 7 failed after 3 attempt") as info:
        score_teacher(teacher, batch, retries=2, step=7)
    assert isinstance(info.value, TrainingAborted)  # harness run: status failed, exit 1, the message printed
    assert teacher.calls == 3 and torch.equal(batch.teacher_logprobs, before)


def test_the_run_records_the_topk_signal_it_uses(tmp_path):
    from opd_harness.store import Store
    from opd_harness.runs import create_train_run

    plan = plan_run(build_config(preset="smoke", overrides=[*SERVED, "teacher.top_k=5"]))
    store = Store(tmp_path)
    run_id = create_train_run(store, plan.config, plan)
    record = json.loads((store.run_dir(run_id) / "method.json").read_text())
    assert "teacher_dist" in record["inputs"] and record["teacher_kinds"] == ["full", "topk", "student_topk"]
    assert "top-k teacher signal" in record["notes"]["estimator"] and "lower bound" in record["notes"]["estimator"]
    assert any("teacher.signal=topk" in w for w in record["warnings"])
    teacher = json.loads((store.run_dir(run_id) / "config.json").read_text())["teacher"]
    assert (teacher["signal"], teacher["top_k"]) == ("topk", 5)


# ----------------------------------------------------------------------------- end to end against harness serve


def harness_run(out, *overrides: str):
    """``harness run --preset smoke`` in a subprocess (as a user runs it); training only, no evaluation rows to spare time."""
    import subprocess
    import sys

    sets = ["eval.teacher=false", "eval.before_training=false", *overrides]
    args = [sys.executable, "-m", "opd_harness.cli", "run", "--preset", "smoke", "--out", str(out),
            *(a for s in sets for a in ("--set", s))]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def train_runs(out) -> list[dict]:
    from opd_harness.store import Store

    return [r for r in Store(out).runs() if r["kind"] == "train"]


@pytest.mark.slow
def test_smoke_run_with_a_served_teacher_trains_as_with_the_in_process_teacher(tmp_path):
    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import load_model_and_tokenizer
    from opd_harness.serve import make_app
    from opd_harness.store import Store
    from serving import Probe, running

    out = tmp_path / "results"
    local = harness_run(out)
    assert local.returncode == 0, local.stderr
    (teacher_dir,) = (out / "cache" / "models").glob("teacher-*")  # the preset's tiny teacher, built and warmed up by that run
    model, tokenizer = load_model_and_tokenizer(teacher_dir)
    vocab = len(tokenizer)
    probe = Probe(make_app(HFBackend(model, tokenizer), model_name="teacher", max_logprobs=-1))
    with running(probe) as base:
        url = base + "/v1"
        served = harness_run(out, "teacher.backend=openai", f"teacher.base_url={url}", f"teacher.top_k={vocab}")
        assert served.returncode == 0, served.stderr
        assert probe.posts > 0 and all(b.get("echo") for b in probe.bodies)  # the steps were scored by the server
        # the server fails every scoring request: the step is retried once, then the run stops, untrained
        probe.reset()
        probe.fail_next = [500] * 100
        failed = harness_run(out, "teacher.backend=openai", f"teacher.base_url={url}", "teacher.backend_options.max_retries=0")
    assert failed.returncode == 1
    message = " ".join(failed.stderr.split())
    assert "teacher scoring of step 1 failed after 2 attempt(s) (InternalServerError" in message and "the step was not trained" in message
    store = Store(out)
    first, second, third = (r["run_id"] for r in train_runs(out))
    assert store.get_run(third)["status"] == "failed" and store.step_metrics(third) == {}
    local_steps, served_steps = store.step_metrics(first), store.step_metrics(second)
    assert sorted(served_steps) == sorted(local_steps) == [1, 2, 3, 4]
    for step in local_steps:
        for name in ("loss", "teacher_kl", "teacher_kl_full"):
            assert served_steps[step][name] == pytest.approx(local_steps[step][name], abs=1e-4), (step, name)
    print("served vs in-process teacher, max |Δloss| =", max(abs(served_steps[s]["loss"] - local_steps[s]["loss"]) for s in local_steps))
    signals = [json.loads((store.run_dir(run) / "config.json").read_text())["teacher"] for run in (first, second)]
    assert [(s["signal"], s["top_k"]) for s in signals] == [("full", 20), ("topk", vocab)]  # hidden states + head vs top-V


def test_ray_teacher_actor_opens_the_served_teacher_itself(tmp_path):
    """With ``--executor ray`` no teacher model is shipped: the actor connects to ``teacher.base_url`` and scores there."""
    from opd_harness.backends.hf import HFBackend
    from opd_harness.backends.openai_backend import OpenAIBackend
    from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, save_model_and_tokenizer
    from opd_harness.serve import make_app
    from opd_harness.trajectory import TensorBatch
    from serving import running
    from opd_harness.trainers.ray_executor import TeacherActor

    tok = build_char_tokenizer()
    model = build_tiny_model(
        TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64), len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=5
    )
    save_model_and_tokenizer(model, tok, tmp_path / "teacher")
    hf = HFBackend(model, tok)
    ids = torch.tensor([tok("12+30=42", add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros(ids.shape)
    loss_mask[0, 6:] = 1
    with running(make_app(hf, model_name="teacher", max_logprobs=-1)) as base:
        url = base + "/v1"
        cfg = build_config(preset="smoke", overrides=[*SERVED[:1], f"teacher.base_url={url}", "teacher.top_k=4"])
        plan = plan_run(cfg)
        cfg.method_args["opd"] = plan.hparams.model_dump()  # as create_train_run records it
        actor = TeacherActor(cfg.model_dump(mode="json"), None, str(tmp_path / "teacher"), torch.get_num_threads())
        assert isinstance(actor.backend, OpenAIBackend) and actor.backend.model == "teacher"  # the server's only model
        zeros = torch.zeros(ids.shape)
        batch = TensorBatch(
            ids,
            mask,
            loss_mask,
            torch.zeros_like(ids),
            zeros,
            zeros.clone(),
            torch.full((1,), float("nan")),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
        )
        batch, _ = actor.score(batch, {}, 1)
    expected = hf.score(ids, mask, want=("logprobs", "topk"), top_k=4)
    assert torch.allclose(batch.teacher_logprobs, expected["logprobs"] * loss_mask, atol=1e-4)
    assert torch.allclose(batch.teacher_dist.logp[0, 1:], expected["topk_logprobs"][0, 1:], atol=1e-4)
    assert batch.teacher_dist.kind == "topk"


# ----------------------------------------------------------------------------- teacher replicas (a list of base URLs)


class RowTeacher:
    """Scores row r at -(r+1) for every token, counting its calls and rows; fails every call while ``down``."""

    def __init__(self, *, down: bool = False) -> None:
        self.down, self.calls, self.rows = down, 0, 0
        self.tokenizer = None

    def score(self, input_ids, attention_mask, want=("logprobs",), top_k=0):
        self.calls += 1
        if self.down:
            raise ConnectionError("replica went away")
        self.rows += len(input_ids)
        return {"logprobs": -input_ids[:, :1].float().expand(input_ids.shape).clone()}


def row_ids(rows: int) -> torch.Tensor:
    return torch.arange(1, rows + 1).unsqueeze(1).expand(rows, 3).clone()


def test_a_teacher_pool_splits_rows_over_replicas_and_keeps_their_order():
    from opd_harness.trainers.teacher import TeacherPool, row_shards

    assert row_shards(5, 2) == [slice(0, 3), slice(3, 5)] and row_shards(1, 3) == [slice(0, 1)] and row_shards(0, 2) == [slice(0, 0)]
    replicas = [RowTeacher(), RowTeacher(), RowTeacher()]
    ids = row_ids(7)
    scores = TeacherPool(replicas, ["a", "b", "c"]).score(ids, torch.ones_like(ids))
    assert torch.equal(scores["logprobs"], -ids.float())
    assert [r.rows for r in replicas] == [3, 2, 2]  # every replica scored a contiguous shard


def test_a_failed_replica_s_rows_go_to_the_others_and_it_is_benched(monkeypatch):
    from opd_harness.trainers.teacher import TeacherPool

    replicas = [RowTeacher(), RowTeacher(down=True)]
    pool = TeacherPool(replicas, ["a", "b"])
    ids = row_ids(4)
    assert torch.equal(pool.score(ids, torch.ones_like(ids))["logprobs"], -ids.float())
    assert replicas[0].rows == 4 and replicas[1].calls == 1 and pool.failovers == 1
    pool.score(ids, torch.ones_like(ids))  # benched: the next call does not ask it
    assert replicas[1].calls == 1 and replicas[0].rows == 8
    pool.benched_until[1] = 0.0  # its bench is over and it is back
    replicas[1].down = False
    pool.score(ids, torch.ones_like(ids))
    assert replicas[1].rows == 2


def test_when_every_replica_fails_the_step_retry_rule_stops_the_step(no_sleep):
    from opd_harness.trainers.teacher import TeacherPool

    replicas = [RowTeacher(down=True), RowTeacher(down=True)]
    batch = make_batch([[1, 1]], [[0.0] * 2], [[0.0] * 2])
    with pytest.raises(TeacherFailed, match=r"step 4 failed after 2 attempt.*every teacher replica failed \(a: ConnectionError"):
        score_teacher(TeacherPool(replicas, ["a", "b"]), batch, retries=1, step=4)


def test_teacher_replicas_listed_once_each():
    cfg = build_config(preset="smoke", overrides=["teacher.backend=openai", "teacher.base_url=[http://a:1/v1, http://b:2/v1]"])
    assert cfg.teacher.base_url == ["http://a:1/v1", "http://b:2/v1"]
    with pytest.raises(ValueError, match="name one server twice"):
        build_config(preset="smoke", overrides=["teacher.backend=openai", "teacher.base_url=[http://a:1/v1, http://a:1/v1]"])


def test_two_served_replicas_score_like_one_and_survive_one_going_down(tmp_path):
    """Two `harness serve` replicas of the teacher behind one client: each scores part of a batch; with one failing every
    request, the other scores all of it; the log-probs equal the model's own either way."""
    from opd_harness.backends.hf import HFBackend
    from opd_harness.models.tiny import load_model_and_tokenizer
    from opd_harness.serve import make_app
    from serving import Probe, running, saved_tiny_model
    from opd_harness.trainers.teacher import TeacherPool, open_remote_teacher

    folder = saved_tiny_model(tmp_path, seed=3)
    model, tok = load_model_and_tokenizer(folder)
    hf = HFBackend(model, tok)
    texts = ["12+30=42", "7+8=15", "100+1=101", "3+4=7"]
    encoded = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    ids = torch.tensor([e + [tok.pad_token_id] * (width - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded])
    expected = hf.score(ids, mask, want=("logprobs",))["logprobs"] * mask
    first, second = (Probe(make_app(hf, model_name="teacher", max_logprobs=-1)) for _ in range(2))
    with running(first) as a, running(second) as b:
        overrides = ["teacher.backend=openai", f"teacher.base_url=[{a}/v1, {b}/v1]", "teacher.backend_options.max_retries=0"]
        pool = open_remote_teacher(build_config(preset="smoke", overrides=overrides).teacher, str(folder))
        assert isinstance(pool, TeacherPool) and pool.labels == [f"{a}/v1", f"{b}/v1"]
        scored = pool.score(ids, mask, want=("logprobs",))["logprobs"] * mask
        assert torch.allclose(scored, expected, atol=1e-4) and first.posts == second.posts == 2
        second.fail_next = [500] * 100
        first.reset()
        scored = pool.score(ids, mask, want=("logprobs",))["logprobs"] * mask
    assert torch.allclose(scored, expected, atol=1e-4) and first.posts == 4 and pool.failovers == 1
