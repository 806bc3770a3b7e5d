import math

import pytest
import torch

from opd_harness.trajectory import Segment, Trajectory, to_tensor_batch


def tool_episode() -> Trajectory:
    return Trajectory(
        task="t",
        problem_id="p0",
        sample_index=0,
        prompt_ids=[10, 11, 12],
        segments=[
            Segment("model", [20, 21], step=0, policy_version=5, behaviour_logprobs=[-0.1, -0.2], teacher_logprobs=[-0.3, -0.4]),
            Segment("env", [30, 31, 32]),
            Segment("model", [22, 23, 24], step=1, policy_version=3, behaviour_logprobs=[-0.5, -0.6, -0.7]),
        ],
        reward=1.0,
    )


def test_masks_cover_model_tokens_only_and_steps_are_tagged():
    short = Trajectory(task="t", problem_id="p1", sample_index=0, prompt_ids=[10], segments=[Segment("model", [40], step=0)])
    batch = to_tensor_batch([tool_episode(), short], pad_id=0)
    assert batch.shape == (2, 11)
    assert batch.input_ids[0].tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 22, 23, 24]
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert batch.step_index[0].tolist() == [-1, -1, -1, 0, 0, -1, -1, -1, 1, 1, 1]
    assert batch.behaviour_logprobs[0, 3:5].tolist() == pytest.approx([-0.1, -0.2])
    assert batch.behaviour_logprobs[0, 8:].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert batch.teacher_logprobs[0, 3:5].tolist() == pytest.approx([-0.3, -0.4])
    assert batch.teacher_logprobs[0, 8:].tolist() == [0, 0, 0]  # unknown → 0
    # right padding: masked, not attended
    assert batch.input_ids[1].tolist() == [10, 40] + [0] * 9
    assert batch.attention_mask[1].tolist() == [1, 1] + [0] * 9
    assert batch.loss_mask[1].tolist() == [0, 1] + [0] * 9
    assert batch.rewards[0] == 1.0 and math.isnan(batch.rewards[1])


def test_policy_version_is_the_oldest_and_groups_follow_problems():
    a, b = tool_episode(), tool_episode()
    b.sample_index = 1
    c = Trajectory(task="t", problem_id="p9", sample_index=0, prompt_ids=[1], segments=[Segment("model", [2], step=0)])
    batch = to_tensor_batch([a, b, c], pad_id=0)
    assert a.policy_version == 3
    assert batch.policy_version.tolist() == [3, 3, -1]
    assert batch.group_ids.tolist() == [0, 0, 1]
    assert a.num_steps == 2 and a.num_model_tokens == 5


def test_bad_segments_are_rejected():
    with pytest.raises(ValueError, match="step index"):
        Segment("model", [1])
    with pytest.raises(ValueError, match="2 entries for 1 tokens"):
        Segment("model", [1], step=0, behaviour_logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="zero trajectories"):
        to_tensor_batch([], pad_id=0)


def test_text_views():
    t = tool_episode()
    t.segments[0].text, t.segments[1].text, t.segments[2].text = "a", "[obs]", "b"
    assert t.completion_text == "a[obs]b"
    assert t.response_ids == [20, 21, 30, 31, 32, 22, 23, 24]
    assert isinstance(to_tensor_batch([t], 0).loss_mask, torch.Tensor)
