#!/usr/bin/env bash
# Run from the repository root on a GPU machine: tests the vLLM backend against the HF backend.
# Needs CUDA and a wheelhouse (WHEELHOUSE=dir of wheels: vllm 0.33.0, torch 2.14.0, deps) or a package index.
set -euo pipefail
PY=${PY:-python3.11}
VENV=${VENV:-/tmp/vllm-venv}
FIND=${WHEELHOUSE:+--find-links $WHEELHOUSE}
nvidia-smi -L
$PY -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm first: it pins torch==2.14.0 (CUDA) and transformers<5.21; do NOT install the CPU torch pin
"$VENV/bin/pip" install $FIND "vllm==0.33.0"
# the project without its CPU pins (torch==2.13.0, transformers==5.24.0), then what it imports
"$VENV/bin/pip" install $FIND -e . --no-deps
"$VENV/bin/pip" install $FIND pydantic typer rich tqdm PyYAML "math-verify[antlr4_13_2]==0.9.0" pebble pyarrow \
    starlette uvicorn openai docker safetensors "pytest==9.2.0" "hypothesis==6.170.17"
"$VENV/bin/pip" check || true          # report, don't stop: vllm's own pins win
"$VENV/bin/python" -c "import torch, vllm, transformers; print(torch.__version__, torch.cuda.is_available(), vllm.__version__, transformers.__version__)"
export HF_HUB_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
timeout 900 "$VENV/bin/python" -m pytest -p no:cacheprovider -rs -v tests/test_vllm_backend.py tests/test_tiny_and_backend.py
timeout 900 "$VENV/bin/python" -m pytest -p no:cacheprovider -rs -v -m gpu tests/test_vllm_backend.py
