#!/usr/bin/env bash
# Newer-Python leg: Python 3.13, in a container built from Debian trixie's packages with the sandbox's image tooling
# (mmdebstrap + docker import, never docker pull). The host downloads the wheels for CPython 3.13 (binary wheels only, the
# lock's versions; torch 2.13.0 for cp313 exists here only as the CUDA build, which runs on the CPU), the container installs
# them with no network, imports every module of the package and runs a stated subset of the unit tests: those of the code
# whose behaviour depends on the Python version (packaging metadata and tomllib, entry points, the CLI's argparse/typer
# output, pydantic config models, subprocesses, signals, rlimits and finalizers of both sandbox providers and the
# interpreter, the grader's process pool and signal.alarm, the asyncio server, a tiny model's generate and train step),
# not marked docker, ray, browser, slow or gpu. The whole suite on 3.13 took 40 min under load (2385 s, 1159 tests): over
# CI's budget; run it with `.ci/legs/newer_python.sh -m "not docker and not ray and not browser and not slow and not gpu"`.
# Needs a running dockerd and mmdebstrap (.ci/run sets both up) and network for pip. Prints "leg newer_python: N s".
# `newer_python.sh --prepare` does steps 1 and 2 only (the wheels and the image; .ci/run starts it beside its set-up); a
# later run reuses both: the image by its tag, the wheels while a stamp of the lock, pyproject.toml and this script matches.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
prepare_only=0
if [ "${1:-}" = --prepare ]; then prepare_only=1; shift; fi
trap 'echo "leg newer_python$([ $prepare_only = 0 ] || echo " --prepare"): $((SECONDS - start)) s"' EXIT
cache=${NEWER_PYTHON_CACHE:-.cache/newer-python}    # git-ignored; the rootfs tarball and the wheels are reused when present
packages=python3,python3-venv,git,procps   # git: the local-sandbox SWE-bench agent tests
tag=$(echo "$packages" | sha1sum | cut -c1-8)   # a changed package list builds a new image and rootfs, never reuses a stale one
image=opd-py313:trixie-$tag
mkdir -p "$cache/wheels"
# pytest's arguments in the container: the CI subset unless given (e.g. `.ci/legs/newer_python.sh tests/test_x.py -x`).
[ $# -gt 0 ] || set -- -m "not docker and not ray and not browser and not slow and not gpu" \
  tests/test_packaging.py tests/test_registry.py tests/test_config.py tests/test_cli_startup.py tests/test_cli_help.py \
  tests/test_cli_errors.py tests/test_sandbox.py tests/test_sandbox_lifecycle.py tests/security/test_containment.py \
  tests/test_interpreter.py tests/test_swebench.py tests/test_swebench_agent.py tests/test_math_grading.py \
  tests/test_serve_api.py tests/test_tiny_and_backend.py
step() { echo "  newer_python: $1 at $((SECONDS - start)) s"; }
# One run at a time on a cache: .ci/run starts `--prepare` early and the full leg after the test suite; if the first is
# still downloading or building, the second waits for it here and then reuses what it left.
exec {lock}> "$cache/lock"
flock -n "$lock" || { step "waiting for another newer_python.sh on $cache"; flock "$lock"; }

# 1. The wheels for CPython 3.13 (the resolution itself is the 3.13 check of resolve.sh, here made real). pip download
# --python-version needs binary wheels only: the few lock entries published only as pure-Python sdists are built first.
# Downloaded while the image is built (step 2): one waits on PyPI, the other on the Debian mirror and dpkg.
stamp=$(cat requirements/ci.lock pyproject.toml .ci/sdist_wheels.sh .ci/legs/newer_python.sh | sha1sum | cut -c1-16)   # what the download depends on
download_wheels() {
  if [ "$(cat "$cache/wheels.stamp" 2> /dev/null)" = "$stamp" ]; then
    echo "wheels already downloaded for this lock ($(du -sh "$cache/wheels" | cut -f1))"; return
  fi
  rm -f "$cache/wheels.stamp"
  python3 -m venv "$cache/pipvenv"
  "$cache/pipvenv/bin/pip" install -q pip==26.3 2>&1 | grep -v "is ignored" || true   # as in resolve.sh
  .ci/sdist_wheels.sh "$cache/pipvenv/bin/pip" "$cache/wheels"
  "$cache/pipvenv/bin/pip" download -q --python-version 3.13 --only-binary=:all: --find-links "$cache/wheels" -d "$cache/wheels" \
    -c requirements/ci.lock torch==2.13.0 '.[dev]' setuptools 2>&1 | grep -v "is ignored" || true
  ls "$cache"/wheels/torch-2.13.0-cp313-*.whl > /dev/null   # the download above failed if torch is missing
  echo "$stamp" > "$cache/wheels.stamp"
  echo "wheels downloaded ($(du -sh "$cache/wheels" | cut -f1))"
}
download_wheels > "$cache/download.log" 2>&1 &
download_pid=$!

# 2. The image: Debian trixie's python3 (3.13), venv, git (the local-sandbox SWE-bench agent tests) and procps; nothing from PyPI.
if ! docker image inspect "$image" > /dev/null 2>&1; then
  if [ ! -f "$cache/trixie-$tag.tar" ]; then   # written under another name first: an interrupted build is never reused
    mmdebstrap --variant=apt --format=tar --quiet --include="$packages" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' trixie "$cache/trixie.partial.tar"
    mv "$cache/trixie.partial.tar" "$cache/trixie-$tag.tar"
  fi
  docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' -c 'ENV LANG=C.UTF-8' \
    "$cache/trixie-$tag.tar" "$image" > /dev/null
fi
step "image ready"

if ! wait "$download_pid"; then cat "$cache/download.log"; echo "newer_python: the wheel download failed"; exit 1; fi
step "$(tail -n 1 "$cache/download.log")"
[ $prepare_only = 0 ] || exit 0

# 3. Install and test in the container, offline: the checkout's tracked and untracked-but-not-ignored files only.
mkdir -p "$cache/src" && rm -rf "$cache/src"/* && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$cache/src"
docker run --rm --network none -v "$PWD/$cache/src:/src:ro" -v "$PWD/$cache/wheels:/wheels:ro" \
  -v "${HARNESS_DATA_DIR:-$PWD/../shared/data}:/data:ro" "$image" bash -euo pipefail -c '
    python3 --version
    cp -r /src /work && cd /work
    python3 -m venv /venv
    # --no-compile: pip byte-compiles every installed file (torch, transformers, ...) by default. Measured 2026-12-07 in
    # this image, load ~30: 540 s with it; 319 s without, plus 50 s for the first import of the package, torch and
    # transformers. What the tests import is compiled as they import it (every opd_harness module is imported below).
    /venv/bin/pip install -q --no-compile --no-index --find-links /wheels -c requirements/ci.lock torch==2.13.0 -e ".[dev]"
    echo "  newer_python: installed $(/venv/bin/python -c "import torch, transformers; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__)")"
    /venv/bin/python - <<PY   # every module imports on this Python (removed stdlib modules, changed APIs)
import importlib, pkgutil, tomllib
packages = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["packages"]  # every package of the wheel, each listed
names = list(packages)
for package in packages:
    path = importlib.import_module(package).__path__
    names += [m.name for m in pkgutil.iter_modules(path, package + ".") if not m.ispkg and not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(f"  newer_python: all {len(names)} modules of opd_harness import")
PY
    HARNESS_DATA_DIR=/data OMP_NUM_THREADS=2 /venv/bin/python -m pytest -q -p no:cacheprovider "$@"' newer_python "$@"
