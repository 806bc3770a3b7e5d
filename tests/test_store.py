import math

from opd_harness.store import SampleRow, Store


def summary(avg=0.5):
    return {"k": 2, "n_samples": 4, "n_problems": 2, "avg_at_k": avg, "ci_low": 0.1, "ci_high": 0.9, "pass_at_k": 0.75, "n_errors": 1}


def rows():
    return [
        SampleRow("p0", 0, "\\boxed{1}", "1", 1.0, "pass", 0.01),
        SampleRow("p0", 1, "x", None, 0.0, "fail", 0.01, "no answer"),
        SampleRow("p1", 0, "\\boxed{2}", "2", 0.0, "fail", 0.02),
        SampleRow("p1", 1, "\\boxed{9^9^9}", "9^9^9", 0.0, "error", 0.02, "timeout"),
    ]


def test_round_trip_and_wal(tmp_path):
    with Store(tmp_path) as store:
        assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        store.create_run("r1", kind="train", config={"a": 1}, method="opd", task="arith")
        store.log_step("r1", 1, {"loss": 0.5, "kl": 0.1})
        store.add_checkpoint("r1", 1, path="/x", samples_seen=64, train_seconds=2.0)
        store.add_eval("r1", 1, "arith", summary(), rows(), grader="math-verify", grader_version="0.9.0")
    with Store(tmp_path) as store:  # reopened from disk
        run = store.get_run("r1")
        assert run["config"] == {"a": 1} and run["status"] == "running"
        assert store.step_metrics("r1") == {1: {"loss": 0.5, "kl": 0.1}}
        ckpt = store.checkpoints("r1")[0]
        assert ckpt["samples_per_hour"] == 64 / 2.0 * 3600
        (ev,) = store.evals("r1")
        assert (ev["avg_at_k"], ev["n_errors"], ev["grader_version"]) == (0.5, 1, "0.9.0")
        samples = store.samples("r1", 1, "arith")
        assert [s["status"] for s in samples] == ["pass", "fail", "fail", "error"]
        assert samples[3]["details"] == "timeout"


def test_rewrites_never_duplicate_rows(tmp_path):
    with Store(tmp_path) as store:
        store.create_run("r1", kind="train", config={})
        for _ in range(3):
            store.log_step("r1", 1, {"loss": 0.5})
            store.add_checkpoint("r1", 1, path=None, samples_seen=1, train_seconds=1.0)
            store.add_eval("r1", 1, "arith", summary(0.75), rows(), grader="g", grader_version="1")
        assert store.count("step_metrics", "r1") == 1
        assert store.count("checkpoints", "r1") == 1
        assert store.count("evals", "r1") == 1
        assert store.count("samples", "r1") == 4
        store.log_step("r1", 2, {"loss": 0.4})
        store.delete_steps_after("r1", 1)
        assert list(store.step_metrics("r1")) == [1]


def test_nonfinite_step_metrics_read_back_as_what_they_were(tmp_path):
    """SQLite stores a bound NaN as NULL; the store keeps NaN and ±inf so a diverged loss is never read as missing."""
    with Store(tmp_path) as store:
        store.create_run("r1", kind="train", config={})
        store.log_step("r1", 1, {"loss": float("nan"), "grad_norm": float("inf"), "kl": float("-inf"), "lr": 1e-3})
    with Store(tmp_path) as store:  # reopened from disk
        got = store.step_metrics("r1")[1]
    assert math.isnan(got["loss"]) and got["grad_norm"] == math.inf and got["kl"] == -math.inf and got["lr"] == 1e-3
    assert all(isinstance(v, float) for v in got.values())


def test_failed_eval_write_leaves_nothing(tmp_path):
    with Store(tmp_path) as store:
        store.create_run("r1", kind="eval", config={})
        bad = rows() + [SampleRow("p2", 0, "", None, 0.0, "maybe", 0.0)]  # invalid status
        try:
            store.add_eval("r1", 0, "arith", summary(), bad, grader="g", grader_version="1")
        except Exception:
            pass
        else:
            raise AssertionError("an invalid status must be refused")
        assert store.count("samples", "r1") == 0 and store.count("evals", "r1") == 0


def test_restored_scheduler_puts_the_saved_learning_rate_back():
    """A warm-up schedule resumed at step 3 must train step 4 at the step-3 rate, not the first warm-up rate."""
    import torch

    from opd_harness.trainers.checkpoint import restore_scheduler

    def factory(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = factory(opt)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_lr, saved = opt.param_groups[0]["lr"], sched.state_dict()
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    restored = restore_scheduler(fresh, factory, saved)
    assert saved_lr == 0.4
    assert fresh.param_groups[0]["lr"] == restored.get_last_lr()[0] == saved_lr
