"""Async pipeline: lag accounting, the max_lag bound, lag 0 ≡ sync, refresh semantics."""

import json
import random
import sqlite3
import time

import pytest
import torch
from typer.testing import CliRunner

import opd_harness.trainers.inprocess as ip
import opd_harness.trainers.loop as ap
from opd_harness.cli import app
from opd_harness.trainers.loop import BufferEntry, ReplayBuffer, Unit, WorkQueue, fixed_version, required_version

runner = CliRunner()
BASE = [
    "run",
    "--task",
    "arith",
    "--preset",
    "smoke",
    "--set",
    "threads=1",
    "--set",
    "eval.teacher=false",
    "--set",
    "eval.before_training=false",
]


def run(out, *extra):
    result = runner.invoke(app, [*BASE, "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(out / "results.sqlite") as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE kind='train' ORDER BY created_at DESC").fetchone()
        rows = conn.execute("SELECT step, name, value FROM step_metrics WHERE run_id=?", (run_id,)).fetchall()
        ckpt = conn.execute("SELECT metrics_json FROM checkpoints WHERE run_id=? ORDER BY step DESC", (run_id,)).fetchone()
    metrics: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        metrics.setdefault(step, {})[name] = value
    return metrics, ckpt[0]


def test_work_queue_hands_out_the_lowest_batch_once():
    queue = WorkQueue(start=2, steps=6)
    assert [queue.claim(), queue.claim()] == [Unit(3), Unit(4)]  # two workers
    queue.give_back([Unit(3)])  # refused (a refresh) or lost with its replica
    assert [queue.claim(), queue.claim(), queue.claim(), queue.claim()] == [Unit(3), Unit(5), Unit(6), None]


def test_work_queue_hands_out_prompt_groups_batch_by_batch():
    queue = WorkQueue(start=0, steps=2, groups=3)
    claimed = [queue.claim() for _ in range(4)]
    assert [(u.index, u.group, u.groups) for u in claimed] == [(1, 0, 3), (1, 1, 3), (1, 2, 3), (2, 0, 3)]
    queue.give_back([Unit(1, 1)])  # a lost group comes back before the later batch's groups
    assert queue.waiting_below(2) and not queue.waiting_below(1)
    assert (queue.claim(), queue.claim()) == (Unit(1, 1), Unit(2, 1))


class FakeRollout:
    """A rollout replica whose batches take a random time; it records the weights each batch was made with."""

    def __init__(self, rng: random.Random) -> None:
        self.version, self.rng, self.lock = -1, rng, ap.threading.Lock()

    def load(self, version: int) -> None:
        self.version = version

    def make(self, unit):
        with self.lock:
            pause = self.rng.uniform(0.0, 0.02)
        time.sleep(pause)
        return None, {"rows": 1.0}


@pytest.mark.parametrize("max_lag, fixed_lag, replicas, groups",
                         [(1, None, 3, 1), (2, None, 3, 1), (0, 2, 3, 1), (1, None, 1, 1), (2, None, 2, 3), (0, 2, 2, 3)])  # fmt: skip
def test_admission_bounds_every_batch_across_workers(max_lag, fixed_lag, replicas, groups):
    """Workers on one queue (whole batches, or 3 prompt groups per batch, several in flight per worker), a learner of
    random speed and refreshes: every batch is trained once, in order, with lag ≤ max_lag (or exactly the fixed lag)
    for every unit, and the workers really ran ahead and shared the work."""
    rng, steps = random.Random(max_lag), 30
    schedule = ap.Schedule(steps, max_lag=max_lag, fixed_lag=fixed_lag, sync_every=1)
    board, buffer, queue = ap.WeightBoard(schedule.keep), ReplayBuffer(groups), WorkQueue(0, steps, groups)
    pause = ap.threading.Event()
    pause.set()
    board.publish_snapshot(0, None)
    workers = [ap.RolloutWorker(schedule, FakeRollout(rng), board, buffer, queue, pause, n, inflight=groups) for n in range(replicas)]
    for worker in workers:
        worker.start()
    lags, makers = [], set()
    try:
        for step in range(1, steps + 1):
            entry = buffer.take(step)
            assert [e.group for e in entry.entries] == list(range(groups))
            if fixed_lag is not None:
                assert {e.version for e in entry.entries} == {entry.version}  # every group of a batch: the same weights
            lags.append((step - 1) - entry.version)
            makers.update(e.worker for e in entry.entries)
            time.sleep(rng.uniform(0.0, 0.01))
            board.publish_snapshot(step, None)
            if fixed_lag is None and step % 7 == 0:  # a refresh: stale batches go back to the queue
                queue.give_back(buffer.drop_stale())
    finally:
        buffer.stop()
        board.stop()
    if fixed_lag is not None:
        assert lags == [min(step - 1, fixed_lag) for step in range(1, steps + 1)]
    else:
        assert max(lags) == max_lag  # ≤ the bound, and the bound was reached
    assert makers == set(range(replicas)) and len(buffer) == 0


def test_version_rules():
    assert [required_version(b, 0) for b in (1, 2, 5)] == [0, 1, 4]
    assert [required_version(b, 2) for b in (1, 2, 3, 4, 7)] == [0, 0, 0, 1, 4]
    assert [fixed_version(b, 2) for b in (1, 2, 3, 4, 7)] == [0, 0, 0, 1, 4]


def entry(index, version, epoch=0):
    return BufferEntry(index, version, epoch, batch=None)


def test_refresh_drops_exactly_the_stale_batches():
    buffer = ReplayBuffer()
    for index, version in [(6, 5), (7, 5), (8, 6)]:  # learner at version 5: batch 6 is fresh, 7 and 8 stale
        assert buffer.put(entry(index, version))
    assert buffer.drop_stale() == [Unit(7), Unit(8)]
    assert buffer.epoch == 1  # every worker re-syncs its weights before its next batch
    assert buffer.take(6).version == 5
    assert not buffer.put(entry(7, 5, epoch=0))  # generated before the refresh: refused
    assert buffer.put(entry(7, 6, epoch=1))


@pytest.mark.slow
def test_async_with_lag_zero_reproduces_sync(tmp_path):
    steps = ["--set", "trainer.steps=6", "--set", "trainer.checkpoint_every=3"]
    sync, _ = run(tmp_path / "sync", "--method", "opd", *steps)
    lag0, _ = run(tmp_path / "async", "--method", "opd", "--mode", "async", "--set", "trainer.max_lag=0", *steps)
    assert sorted(sync) == sorted(lag0) == list(range(1, 7))
    assert [lag0[s]["loss"] for s in range(1, 7)] == pytest.approx([sync[s]["loss"] for s in range(1, 7)], abs=1e-6)
    assert all(lag0[s]["lag_max"] == 0 for s in lag0)


@pytest.mark.slow
def test_fixed_lag_accounting_is_exact(tmp_path):
    metrics, ckpt = run(tmp_path, "--method", "opd", "--mode", "async", "--set", "trainer.fixed_lag=2", "--set", "trainer.steps=6")
    for step in range(1, 7):
        assert metrics[step]["lag_mean"] == metrics[step]["lag_max"] == min(step - 1, 2)
        assert metrics[step]["behaviour_version"] == max(step - 3, 0)
    assert '"staleness_hist": {"0": 8, "1": 8, "2": 32}' in ckpt


@pytest.mark.slow
@pytest.mark.parametrize("max_lag, sync_every", [(1, 1), (2, 3)])
def test_max_lag_is_never_exceeded_under_random_timing(tmp_path, monkeypatch, max_lag, sync_every):
    rng = random.Random(max_lag)
    original = ip.learn

    def slow_learn(*args, **kwargs):  # a learner slower than the worker: the buffer fills, lag grows
        time.sleep(rng.uniform(0.0, 0.08))
        return original(*args, **kwargs)

    monkeypatch.setattr(ip, "learn", slow_learn)
    metrics, _ = run(tmp_path, "--method", "opd", "--mode", "async", "--set", f"trainer.max_lag={max_lag}",
                     "--set", f"trainer.sync_every={sync_every}", "--set", "trainer.steps=12",
                     "--set", "trainer.checkpoint_every=6")  # fmt: skip
    lags = [metrics[s]["lag_max"] for s in range(1, 13)]
    assert max(lags) <= max_lag
    assert max(lags) == max_lag  # the worker really ran ahead (otherwise the bound was never tested)


@pytest.mark.slow
def test_hard_refresh_regenerates_stale_batches(tmp_path, monkeypatch):
    buffers: list[ReplayBuffer] = []
    original_init, original_learn = ReplayBuffer.__init__, ip.learn
    monkeypatch.setattr(ReplayBuffer, "__init__", lambda self, *a: (original_init(self, *a), buffers.append(self))[0])

    def learn_after_the_worker_ran_ahead(plan, *args, **kwargs):
        """Each step but the last waits (up to 3 s) until the worker has buffered a later batch, so that refreshes
        find stale ones however loaded the machine is."""
        last = args[4] + 1 >= plan.config.trainer.steps  # args[4]: the learner version, i.e. step - 1
        deadline = time.monotonic() + 3  # a step right after a refresh waits for new weights: no batch can be ahead
        while not last and not buffers[-1]._entries and time.monotonic() < deadline:
            time.sleep(0.01)
        return original_learn(plan, *args, **kwargs)

    monkeypatch.setattr(ip, "learn", learn_after_the_worker_ran_ahead)
    metrics, ckpt = run(tmp_path, "--method", "opd_hard_refresh", "--mode", "async",
                        "--set", "method_args.opd_hard_refresh.refresh_every=3",
                        "--set", "trainer.max_lag=3", "--set", "trainer.steps=12", "--set", "trainer.checkpoint_every=6")  # fmt: skip
    refresh_steps = [s for s in range(1, 13) if metrics[s]["refresh_signal"] > 0]
    assert refresh_steps == [3, 6, 9, 12]
    for s in refresh_steps[:-1]:
        assert metrics[s + 1]["lag_max"] == 0  # everything after a refresh comes from the newest weights
    assert metrics[12]["refreshes"] == 4 and metrics[12]["dropped_batches"] > 0
    assert '"refreshes": 4' in ckpt


def test_weight_board_keeps_recent_versions():
    board = ap.WeightBoard(keep=2)
    model = torch.nn.Linear(2, 2)
    for v in range(4):
        board.publish_snapshot(v, ap.state_snapshot(model))
    assert board.latest == 3 and board.wait_for(2) == 3
    board.get(3), board.get(2)
    with pytest.raises(KeyError):
        board.get(1)


@pytest.mark.slow
def test_f_opd_async_smoke_records_lag_freshness_and_throughput(tmp_path):
    metrics, ckpt = run(tmp_path, "--method", "f_opd", "--mode", "async")
    assert set(metrics) == {1, 2, 3, 4}
    for step in metrics.values():
        assert {"lag_mean", "lag_max", "freshness_mean", "weight_mean", "samples_per_s", "idle_ratio_rollout", "idle_ratio_learner"} <= set(
            step
        )
        assert 0 < step["freshness_mean"] <= 1 and step["lag_max"] <= 1
    assert '"staleness_hist"' in ckpt and '"idle_ratio_learner"' in ckpt


@pytest.mark.slow
def test_fixed_lag_resume_ramps_lag_back_up_and_keeps_counters(tmp_path, monkeypatch):
    """Only the checkpoint's weights survive a restart: after resuming at step 2 with fixed lag 2, batch 3
    uses version 2 (lag 0), batch 4 version 2 (lag 1), then lag 2 again; the staleness histogram and
    stage clocks continue from the checkpoint instead of restarting at zero."""
    out = tmp_path / "resume"
    args = [
        "--method",
        "opd",
        "--mode",
        "async",
        "--set",
        "trainer.fixed_lag=2",
        "--set",
        "trainer.steps=6",
        "--set",
        "trainer.checkpoint_every=2",
    ]
    original = ap.Session.record_step

    def interrupt_after_checkpoint(self, step, *a, **kw):
        if step == 3:
            raise KeyboardInterrupt  # as if the run were stopped between checkpoints
        return original(self, step, *a, **kw)

    monkeypatch.setattr(ap.Session, "record_step", interrupt_after_checkpoint)
    runner.invoke(app, [*BASE, "--out", str(out), *args])
    monkeypatch.setattr(ap.Session, "record_step", original)
    with sqlite3.connect(out / "results.sqlite") as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs WHERE kind='train'").fetchone()
        before = conn.execute("SELECT metrics_json FROM checkpoints WHERE run_id=? AND step=2", (run_id,)).fetchone()[0]
    result = runner.invoke(app, ["run", "--resume", run_id, "--out", str(out)])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(out / "results.sqlite") as conn:
        rows = conn.execute("SELECT step, value FROM step_metrics WHERE run_id=? AND name='lag_max' ORDER BY step", (run_id,)).fetchall()
        final = conn.execute("SELECT metrics_json FROM checkpoints WHERE run_id=? AND step=6", (run_id,)).fetchone()[0]
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in rows] == [0.0, 1.0, 0.0, 1.0, 2.0, 2.0]
    hist_before, hist_final = json.loads(before)["staleness_hist"], json.loads(final)["staleness_hist"]
    per_batch = sum(hist_before.values()) // 2
    assert hist_final == {"0": 2 * per_batch, "1": 2 * per_batch, "2": 2 * per_batch}
    assert json.loads(final)["learner_seconds"]["train"] > json.loads(before)["learner_seconds"]["train"]
