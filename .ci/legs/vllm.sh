#!/usr/bin/env bash
# The vLLM leg: the real vllm 0.33.0 (a CUDA-only wheel, imported here on the CPU) in its own virtualenv, resolved in ONE
# pip command with this package and its dev extra, so the package's declared ranges must admit what vLLM pins (torch
# 2.14.0, transformers >=5.16.1,<5.21). Then: the API-conformance tests (tests/test_vllm_api.py) with
# HARNESS_REQUIRE_VLLM=1, so a missing vllm fails instead of skipping; and the backend, rollout, weight-sync and learner
# tests beside those versions. The venv lives in .cache/ (git-ignored) and is reused when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
started=$SECONDS
venv=.cache/venv-vllm
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q 'vllm==0.33.0' -e '.[dev]'
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"vllm leg: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
assert vllm.__version__ == "0.33.0" and torch.__version__.startswith("2.14."), "not the versions vLLM 0.33.0 pins"
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
assert (5, 16) <= (major, minor) < (5, 21), f"transformers {transformers.__version__} is outside vLLM 0.33.0's >=5.16.1,<5.21"
PY
installed=$SECONDS
HARNESS_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_api.py
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu and not docker" \
  tests/test_vllm_backend.py tests/test_tiny_and_backend.py tests/test_rollout_backend.py tests/test_rollout_streaming.py \
  tests/test_teacher_signal.py tests/test_learner_step_cost.py
echo "vllm leg: install $((installed - started)) s, tests $((SECONDS - installed)) s"
