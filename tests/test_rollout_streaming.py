"""Rollout units smaller than a batch (``trainer.rollout_unit=group``): workers stream prompt groups, a straggling group
holds only itself, and the learner still gets the same batch, assembled in group order."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import opd_harness.trainers.loop as ap
from opd_harness.trajectory import Segment, Trajectory, concat_batches, to_tensor_batch
from test_ray_executor import assert_same_run, run
from opd_harness.trainers.loop import BufferEntry, ReplayBuffer, Unit, WorkQueue, merge_metrics, unit_problems


def trajectory(problem: str, sample: int, prompt: int, response: int, version: int) -> Trajectory:
    return Trajectory("t", problem, sample, list(range(1, prompt + 1)), reward=float(sample),
                      segments=[Segment("model", [7] * response, step=0, policy_version=version,
                                        behaviour_logprobs=[-0.5] * response)])  # fmt: skip


def test_joined_units_equal_the_batch_packed_at_once():
    """Joining the groups' tensors gives exactly what packing all the batch's trajectories at once gives (widths,
    padding, masks, step indices, group ids renumbered across groups)."""
    groups = [[trajectory("a", s, 3, 2 + s, 0) for s in range(2)], [trajectory("b", s, 5, 4, 1) for s in range(2)],
              [trajectory("c", 0, 2, 1, 1)]]  # fmt: skip
    whole = to_tensor_batch([t for g in groups for t in g], pad_id=9)
    joined = concat_batches([to_tensor_batch(g, pad_id=9) for g in groups])
    for name in whole.__dataclass_fields__:
        expected, got = getattr(whole, name), getattr(joined, name)
        assert (expected is None and got is None) or torch.equal(expected.nan_to_num(-1.0), got.nan_to_num(-1.0)), name
    assert joined.group_ids.tolist() == [0, 0, 1, 1, 2]


def test_a_unit_s_prompts_are_its_contiguous_share_of_the_batch():
    problems = list("abcdef")
    assert [unit_problems(problems, Unit(1, g, 6)) for g in range(6)] == [[p] for p in problems]
    assert [unit_problems(problems, Unit(1, g, 4)) for g in range(4)] == [["a"], ["b", "c"], ["d"], ["e", "f"]]
    assert unit_problems(problems, Unit(1)) == problems


def test_a_batch_s_metrics_come_from_its_units():
    units = [BufferEntry(1, 0, 0, None, {"time_generate_s": 1.0, "reward_mean": 1.0, "grade_errors": 1.0, "lag_max": 0.0,
                                         "rows": 2.0}, group=0, rows=2),
             BufferEntry(1, 0, 0, None, {"time_generate_s": 2.0, "reward_mean": 0.0, "grade_errors": 0.0, "lag_max": 3.0,
                                         "rows": 6.0}, group=1, rows=6),
             BufferEntry(1, 0, 0, None, {"time_generate_s": 0.5, "reward_mean": float("nan"), "rows": 1.0}, group=2, rows=1)]  # fmt: skip
    merged = merge_metrics(units)
    assert merged == {"time_generate_s": 3.5, "reward_mean": 0.25, "grade_errors": 1.0, "lag_max": 3.0, "rows": 9.0}


class StragglerRollout:
    """A rollout replica whose units take ``fast`` seconds, except one straggling unit; it records when each finished."""

    def __init__(self, slow: Unit, fast: float = 0.01, slow_s: float = 1.0) -> None:
        self.version, self.slow, self.fast, self.slow_s = -1, slow, fast, slow_s
        self.finished: list[tuple[Unit, float]] = []
        self.lock = threading.Lock()

    def load(self, version: int) -> None:
        self.version = version

    def make(self, unit: Unit):
        time.sleep(self.slow_s if unit == self.slow else self.fast)
        with self.lock:
            self.finished.append((unit, time.monotonic()))
        return (unit.index, unit.group), {"rows": 2.0}


@pytest.mark.parametrize("groups", [4, 1])
def test_a_straggling_group_does_not_hold_the_other_groups(groups):
    """One worker, max_lag 1, batch 1's first group straggles: with prompt groups the worker keeps the batch's other
    groups and batch 2's going meanwhile (all done before the straggler), and batch 1 is still assembled in group order.
    With whole batches (groups=1) the same straggler holds batch 2 back (the whole-batch code's behaviour)."""
    steps, slow = 2, Unit(1, 0)
    schedule = ap.Schedule(steps, max_lag=1, fixed_lag=None, sync_every=1)
    board, buffer, queue, pause = ap.WeightBoard(schedule.keep), ReplayBuffer(groups), WorkQueue(0, steps, groups), threading.Event()
    pause.set()
    board.publish_snapshot(0, None)
    rollout = StragglerRollout(slow)
    worker = ap.RolloutWorker(schedule, rollout, board, buffer, queue, pause, inflight=groups)
    worker.start()
    try:
        first = buffer.take(1)
        board.publish_snapshot(1, None)
        second = buffer.take(2)
    finally:
        buffer.stop()
        board.stop()
        worker.join(timeout=5)
    assert [e.batch for e in first.entries] == [(1, g) for g in range(groups)]  # group order, whatever order they finished in
    assert [e.batch for e in second.entries] == [(2, g) for g in range(groups)]
    finished = dict(rollout.finished)
    straggler_done = finished.pop(slow)
    if groups > 1:
        assert all(done < straggler_done for done in finished.values())  # nothing waited for the straggler
        assert second.version == 0  # batch 2 was made before batch 1 was trained on
    else:
        assert all(done > straggler_done for done in finished.values())  # batch 2 waited for batch 1's straggler


@pytest.mark.slow
def test_prompt_groups_give_the_losses_of_whole_batches_in_process(tmp_path):
    """With fixed_lag the batch made of streamed groups is the batch made at once (per-episode seeds): same losses
    (1e-5), behaviour versions and lags."""
    lag = ["--method", "f_opd", "--mode", "async", "--set", "trainer.fixed_lag=1", "--set", "trainer.warmup_steps=3"]
    whole, _, _ = run(tmp_path, *lag)
    grouped, checkpoints, _ = run(tmp_path, *lag, "--set", "trainer.rollout_unit=group")
    assert_same_run(whole, grouped)
    assert [grouped[s]["samples"] for s in grouped] == [8.0] * 4
    assert checkpoints[-1]["rollout_workers"][0]["samples"] == 32


def test_an_engine_not_known_to_be_thread_safe_takes_one_call_at_a_time():
    """Streamed groups call their worker's engine from several threads: engines other than hf and openai (vLLM's offline
    LLM) get one lock around generate and score, so calls never overlap."""
    from concurrent.futures import ThreadPoolExecutor

    from opd_harness.trainers.pipeline import serialize_calls

    class Engine:
        def __init__(self) -> None:
            self.active, self.most = 0, 0

        def generate(self, prompts, params):
            self.active += 1
            self.most = max(self.most, self.active)
            time.sleep(0.01)
            self.active -= 1
            return prompts

    engine = Engine()
    serialize_calls(engine)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda i: engine.generate([i], None), range(8))) == [[i] for i in range(8)]
    assert engine.most == 1
