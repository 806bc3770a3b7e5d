"""The learner's activation peak scales with one ``trainer.forward_tokens`` bucket, not with the step: with the backward one
bucket at a time (``trainer.bucket_backward``, the default) a step of 16 buckets peaks at a few copies of one bucket's
(tokens, V) float32 tensor, where one graph over the step holds every bucket's at once."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS, TOKENS, FORWARD_TOKENS, VOCAB = 32, 128, 256, 32768  # 16 buckets of 2 rows: 4,096 tokens in the step, 256 in a bucket
BUCKET_COPY = FORWARD_TOKENS * VOCAB * 4  # one (bucket tokens, V) float32 tensor: 32 MiB

MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from opd_harness.models.tiny import TinyArch, build_tiny_model
    from opd_harness.registry import METHODS
    from opd_harness.trajectory import TensorBatch
    from opd_harness.trainers.learner import train_step
    from benchmarks.peak_memory import peak_rise

    rows, tokens, forward_tokens, vocab = (int(a) for a in sys.argv[1:5])
    options = json.loads(sys.argv[5])
    model = build_tiny_model(TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, max_positions=tokens), vocab,
                             pad_id=0, eos_id=1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def batch(rows):
        ids = torch.randint(3, vocab, (rows, tokens), generator=g)
        mask = (torch.arange(tokens) >= 8).float().expand(rows, -1).contiguous()
        behaviour = -torch.rand(rows, tokens, generator=g) * 3 * mask
        return TensorBatch(input_ids=ids, attention_mask=torch.ones(rows, tokens, dtype=torch.long), loss_mask=mask,
                           step_index=torch.zeros(rows, tokens, dtype=torch.long), behaviour_logprobs=behaviour,
                           teacher_logprobs=behaviour - 0.1, rewards=torch.zeros(rows), policy_version=torch.zeros(rows, dtype=torch.long),
                           group_ids=torch.arange(rows))
    method = METHODS.get("opd")
    train_step(model, optimizer, batch(2), method, method.hparams(), forward_tokens=forward_tokens, **options)  # AdamW state
    step = batch(rows)
    metrics, rise = peak_rise(lambda: train_step(model, optimizer, step, method, method.hparams(), forward_tokens=forward_tokens,
                                                 **options))
    print(json.dumps({"rise": rise, "loss": metrics["loss"]}))
    """
)


def step_peak(options: dict, root: Path = ROOT) -> int:
    """Peak RSS rise (bytes) of one opd learner step of ``ROWS`` × ``TOKENS`` at ``FORWARD_TOKENS``, in a fresh process
    running the code under ``root`` with ``train_step`` options ``options``. glibc's mmap threshold is held at its start
    (128 KiB), so freed (tokens, V) buffers go back to the system instead of staying in a heap that only grows."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    args = [str(n) for n in (ROWS, TOKENS, FORWARD_TOKENS, VOCAB)] + [json.dumps(options)]
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["rise"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the peak RSS through /proc (Linux)")
def test_a_step_of_many_buckets_peaks_at_about_one_buckets_activations():
    """16 buckets at V = 32,768: the per-bucket backward's peak stays under 6 copies of one bucket's (256, V) float32
    logits (192 MiB; measured 127 MiB); one graph over the step (``bucket_backward=False``: 1,093 MiB, and the learner
    before it, 88020d4: 1,094 MiB) holds about two copies of every bucket's at once."""
    bound = 6 * BUCKET_COPY
    per_bucket = step_peak({})
    one_graph = step_peak({"bucket_backward": False})
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    assert per_bucket < bound, f"the per-bucket backward peaked at {mib(per_bucket)}; bound {mib(bound)}"
    assert one_graph > 2 * bound, f"one graph peaked at {mib(one_graph)}: the bound {mib(bound)} would not tell them apart"
