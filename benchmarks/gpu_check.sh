#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py), runnable on a machine that has torch + transformers but not
# pydantic and no network: run from anywhere; arguments go to gpu_check.py (e.g. --out FILE, --dry-run).
#   benchmarks/gpu_check.sh fetch-wheels   (on a machine with PyPI access) puts the pure-Python wheels the
#                                          harness needs beyond torch/transformers into .gpuwheels/ (~3 MiB)
# Where pydantic does not import, the wheels in .gpuwheels/ are installed into a scratch --target folder
# (never into the machine's environment). PY selects the interpreter (default python3): point it at a
# vllm environment's python to run the vLLM GPU tests as well.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${GPU_WHEELS:-.gpuwheels}  # GPU_WHEELS overrides (tests)
# pydantic as pinned in pyproject.toml, and exactly what pydantic 2.14.4 needs (Python 3.12, x86-64 Linux).
PINS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)

if [[ "${1:-}" == "fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${PINS[@]}"
  ls -l "$WHEELS"
  exit 0
fi

if ! "$PY" -c 'import pydantic' 2> /dev/null; then
  if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "pydantic does not import with $PY and $WHEELS/ holds no wheels: run 'benchmarks/gpu_check.sh fetch-wheels' where PyPI is reachable and bring $WHEELS/ along" >&2
    exit 2
  fi
  SITE=$(mktemp -d /tmp/gpu-check-site.XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# The checkout as the import package opd_harness without installing it (pyproject's package-dir: harness/ is the package,
# tasks/, trainers/, sandbox/ and recipes/ its sub-packages): a scratch folder of links, first on the path.
SRC=$(mktemp -d /tmp/gpu-check-src.XXXXXX)
mkdir "$SRC/opd_harness" && ln -s "$PWD"/harness/* "$SRC/opd_harness/" && ln -s "$PWD"/{tasks,trainers,sandbox,recipes} "$SRC/opd_harness/"
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec "$PY" benchmarks/gpu_check.py "$@"
