"""sft_target: a tiny model's warm-up trains in rounds until a held-out Avg@k (or a cap), on problems kept out of its SFT
data, and what it reached is recorded with the cached model and the run."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from rich.console import Console

from opd_harness.config import ModelSpec, SFTTarget
from opd_harness.models.tiny import TinyArch
from opd_harness.plan import make_task
from opd_harness.task import Problem
from opd_harness.trainers.warmup import RECORD_FILE, WarmupTargetMissed, prepare_model, split_heldout, warm_up, warmup_record

ARCH = TinyArch(hidden=16, layers=1, heads=2, kv_heads=1, ffn=16)


def spec_with(avg_at_k: float, *, max_steps: int = 6, on_miss: str = "fail", seed: int = 0) -> ModelSpec:
    """A 1-layer model, rounds of 2 SFT steps, Avg@1 on 4 held-out problems (greedy-free: temperature 1)."""
    target = SFTTarget(avg_at_k=avg_at_k, max_steps=max_steps, heldout=4, k=1, on_miss=on_miss)
    return ModelSpec(arch=ARCH, sft_steps=2, sft_batch_size=4, seed=seed, sft_target=target)


@pytest.fixture(scope="module")
def arith():
    task = make_task("arith", {"arith": {"max_new_tokens": 8}})
    return task, task.load("train")[:24]


def test_a_reached_target_ends_the_warm_up_after_its_first_round(arith):
    from opd_harness.trainers.warmup import build_model

    task, problems = arith
    spec = spec_with(0.0)
    model, tok = build_model(spec)
    record = warm_up(model, tok, task, problems, spec, desc="t", show_progress=False)
    assert record["reached"] is True and record["steps"] == 2 and len(record["checks"]) == 1
    check = record["checks"][0]
    assert check["steps"] == 2 and check["n_problems"] == 4 and 0.0 <= check["ci_low"] <= check["avg_at_k"] <= check["ci_high"] <= 1.0
    assert record["sft_problems"] == 20 and len(record["heldout_ids"]) == 4 and record["seed"] == 0 and record["threads"] >= 1


def test_the_cap_ends_a_warm_up_below_its_target_and_fails_the_run_naming_the_key(arith, tmp_path):
    task, problems = arith
    spec = spec_with(1.0)  # an all-correct Avg@1 that 6 steps of a 1-layer model never reach
    with pytest.raises(WarmupTargetMissed, match=r"^teacher\.sft_target: held-out Avg@1 0\.\d+ after 6 SFT steps is below avg_at_k 1\.0; "
                                                 r"raise teacher\.sft_target\.max_steps"):
        prepare_model(spec, "teacher", task, problems, tmp_path, show_progress=False)
    (folder,) = (tmp_path / "cache" / "models").iterdir()
    record = warmup_record(folder)
    assert record["reached"] is False and record["steps"] == 6 and [c["steps"] for c in record["checks"]] == [2, 4, 6]
    with pytest.raises(WarmupTargetMissed):  # the cached miss fails again at once, without training
        prepare_model(spec, "teacher", task, problems, tmp_path, show_progress=False)


def test_on_miss_warn_goes_on_with_the_model_and_records_the_miss(arith, tmp_path, capsys):
    task, problems = arith
    _, _, path = prepare_model(spec_with(1.0, max_steps=2, on_miss="warn"), "teacher", task, problems, tmp_path)
    record = json.loads((tmp_path / "cache" / "models" / path.rsplit("/", 1)[-1] / RECORD_FILE).read_text())
    assert record["reached"] is False and record["steps"] == 2
    assert "BELOW target 1.000" in capsys.readouterr().err


def test_what_the_warm_ups_reached_is_stored_with_the_run_and_printed(arith, tmp_path):
    from opd_harness.store import Store
    from opd_harness.trainers.pipeline import record_warmups

    task, problems = arith
    _, _, teacher = prepare_model(spec_with(0.0), "teacher", task, problems, tmp_path, show_progress=False)
    _, _, student = prepare_model(ModelSpec(arch=ARCH, sft_steps=1, sft_batch_size=4, seed=1), "student", task, problems, tmp_path,
                                  show_progress=False)  # fmt: skip
    console = Console(record=True, width=400)
    with Store(tmp_path / "store") as store:
        store.create_run("r", kind="train", config={})
        record_warmups(store, "r", console, {"teacher": teacher, "student": student})
        stored = store.get_run("r")["warmup"]
        on_disk = json.loads((store.run_dir("r") / "warmup.json").read_text())
    assert stored == on_disk and stored["teacher"]["steps"] == 2 and stored["teacher"]["reached"] is True
    assert stored["student"]["steps"] == 1 and stored["student"]["target"] is None and stored["student"]["checks"] == []
    text = console.export_text()
    assert "teacher warm-up: 2 SFT steps (seed 0, " in text and "reached target 0.000" in text
    assert "student warm-up: 1 SFT steps (seed 1" in text


def test_the_held_out_problems_are_disjoint_from_the_sft_data_and_their_duplicates():
    task = make_task("arith_tool", {"arith_tool": {"n_train": 300, "n_test": 10}})
    train = task.load("train")
    sft, heldout = split_heldout(train, spec_with(0.5, seed=3).model_copy(update={"sft_target": SFTTarget(avg_at_k=0.5, max_steps=2,
                                                                                                          heldout=50)}))  # fmt: skip
    assert len(heldout) == 50 and len(sft) == 250
    assert not {p.id for p in sft} & {p.id for p in heldout} and not {p.question for p in sft} & {p.question for p in heldout}
    twin = [Problem("a", "Compute 1+1.\n", "2", "x"), Problem("b", "Compute 2+2.\n", "4", "y"), Problem("c", "Compute 1+1.\n", "2", "x")]
    spec = ModelSpec(arch=ARCH, sft_steps=1, sft_target=SFTTarget(avg_at_k=0.5, max_steps=1, heldout=1))
    for seed in range(6):  # whichever copy is held out, the other one is not trained on
        sft, heldout = split_heldout(twin, spec.model_copy(update={"seed": seed}))
        assert not {p.question for p in sft} & {p.question for p in heldout}
    assert split_heldout(train, ModelSpec(arch=ARCH, sft_steps=1)) == (train, [])  # no target: everything is SFT data, as before


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sft_steps": 0}, "sft_target needs a tiny model warmed up here"),
        ({"sft_steps": 4, "sft_target": {"avg_at_k": 0.5, "max_steps": 6}},
         r"sft_target.max_steps \(6\) must be a multiple of sft_steps \(4\)"),
        ({"sft_steps": 2, "sft_target": {"avg_at_k": 1.5, "max_steps": 6}}, "avg_at_k"),
    ],
)
def test_a_target_that_cannot_be_run_is_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        ModelSpec(**{"arch": ARCH, "sft_target": {"avg_at_k": 0.5, "max_steps": 2}, **fields})


def test_a_named_or_served_teacher_drops_the_presets_warm_up_target():
    from opd_harness.config import build_config

    for overrides in (["teacher.path=/some/teacher"], ["teacher.backend=openai", "teacher.base_url=http://host:1/v1"]):
        cfg = build_config(preset="tool-demo", overrides=overrides)
        assert cfg.teacher.sft_target is None and cfg.teacher.sft_steps == 0
    assert build_config(preset="tool-demo").teacher.sft_target.avg_at_k == 0.85
