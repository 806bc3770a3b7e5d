"""Teacher positions and loss masks on multi-turn tool episodes, the path of the tool demo's full-vocabulary OPD: the
teacher's distribution the pipeline stores at every trained position (``score_teacher``, whole or chunked) and the
objective's per-token KL (``student_outputs``, whole or chunked) equal each model's own forward over exactly that
episode's prefix, computed here row by row without padding; observation tokens and the prompt are never trained on.
(Issue 26: the tool demo's student got worse under OPD; this pins that the teacher is not misaligned there.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from opd_harness.backends.hf import HFBackend
from opd_harness.plan import make_task
from opd_harness.rollout import reference_trajectories
from opd_harness.trajectory import to_tensor_batch
from opd_harness.trainers.learner import student_outputs
from opd_harness.trainers.objectives.opd import OPDParams, opd_objective
from opd_harness.trainers.teacher import score_teacher

TOOL_DEMO_TASK = {"sandbox": "local", "n_train": 3, "n_test": 1, "min_operand": 100, "max_operand": 999, "value_width": 10}


def tool_episodes(tokenizer) -> list:
    """Three arith_tool episodes: two reference ones (call, observation, answer) and a longer one whose first call is
    invalid (call, error observation, call, observation, answer), so the rows have different lengths (padding)."""
    task = make_task("arith_tool", {"arith_tool": TOOL_DEMO_TASK})
    problems = task.read_problems("train", Path("."))
    first_call, answer = problems[2].meta["reference_turns"]
    invalid = {"model": "<code>\nprint(1+\n</code>", "observation": {"content": "Error: invalid tool call", "role": "inline",
                                                                      "raw": "\n<interpreter>\nError: invalid tool call\n</interpreter>\n"}}
    retried = dataclasses.replace(problems[2], meta={"reference_turns": [invalid, first_call, answer]})
    return reference_trajectories(task, [problems[0], problems[1], retried], tokenizer)


def model_positions(traj) -> list[int]:
    """Positions (in the episode's own ids) of the tokens the model wrote, read off the segments, not the batch."""
    positions, at = [], len(traj.prompt_ids)
    for segment in traj.segments:
        if segment.kind == "model":
            positions.extend(range(at, at + len(segment.token_ids)))
        at += len(segment.token_ids)
    return positions


def next_token_logp(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V): log p(· | ids[:t]) for t = 1..len-1, one unpadded forward."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)


@pytest.mark.parametrize("score_chunk, vocab_chunk", [(0, 0), (5, 7)])
def test_teacher_distribution_and_kl_on_multi_turn_episodes_match_a_direct_forward(
    char_tokenizer, tiny_model_factory, score_chunk, vocab_chunk
):
    trajs = tool_episodes(char_tokenizer)
    assert [[s.kind for s in t.segments] for t in trajs][2] == ["model", "env", "model", "env", "model"]
    student, teacher = tiny_model_factory(seed=3, hidden=32), tiny_model_factory(seed=11, hidden=48, layers=2)
    batch = to_tensor_batch(trajs, char_tokenizer.pad_token_id)
    assert (batch.attention_mask == 0).any()  # ragged rows: right padding is exercised
    score_teacher(HFBackend(teacher, char_tokenizer, score_chunk=score_chunk), batch, kind="full")
    outputs, _ = student_outputs(student, batch, full=True, vocab_chunk=vocab_chunk)
    loss, diagnostics = opd_objective(batch, outputs, OPDParams(estimator="full"))

    kls = []
    for row, traj in enumerate(trajs):
        ids = traj.prompt_ids + traj.response_ids
        trained = model_positions(traj)
        mask = [0.0] * batch.input_ids.shape[1]
        for p in trained:
            mask[p] = 1.0
        assert batch.input_ids[row, : len(ids)].tolist() == ids
        assert batch.loss_mask[row].tolist() == mask  # observations, prompt and padding: never trained on
        s, t = next_token_logp(student, ids), next_token_logp(teacher, ids)
        at = [p - 1 for p in trained]  # the distribution that predicts token p comes from the prefix ids[:p]
        assert torch.allclose(batch.teacher_dist[row, trained].log_distribution(), t[at], atol=1e-4)  # hidden states + head
        assert batch.teacher_logprobs[row, trained].tolist() == pytest.approx(t[at, torch.tensor(ids)[trained]].tolist(), abs=1e-4)
        assert outputs.logprobs[row, trained].tolist() == pytest.approx(s[at, torch.tensor(ids)[trained]].tolist(), abs=1e-4)
        kls.append((s[at].exp() * (s[at] - t[at])).sum(-1))
    by_hand = torch.cat(kls).mean()
    assert float(loss.detach()) == pytest.approx(float(by_hand), rel=1e-4)
    assert diagnostics["teacher_kl_full"] == pytest.approx(float(by_hand), rel=1e-4)
    assert diagnostics["tokens"] == sum(len(model_positions(t)) for t in trajs)
