"""Every shipped recipe's paper scale plans offline: ``harness reproduce NAME --scale paper --dry-run`` with the hub off
and an empty hub cache (CI, a cluster's login node) checks and memory-plans every distinct run from the published shapes
of ``harness/models/shapes.py`` (their hub ids and :data:`~opd_harness.models.shapes.HUB_VARIANTS`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd_harness.reproduce import RECIPES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 10-20 s a recipe: one process each, every distinct run validated and planned
@pytest.mark.parametrize("name", sorted(RECIPES.names()))
def test_every_paper_recipe_plans_offline_from_an_empty_hub_cache(name, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "opd_harness", "reproduce", name, "--scale", "paper", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    plans = text.count("\n## plan ")
    assert plans >= 1 and text.count("dry run: every check passed") == plans, text[-3000:]
    assert "error:" not in text and "not in the hub cache; the published shape" in text
