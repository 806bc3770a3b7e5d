#!/usr/bin/env bash
# vLLM source leg: the API-conformance tests (tests/test_vllm_api.py) in source mode, on every CI run. pip downloads
# vLLM 0.33.0's wheel (336 MB, no dependencies, its hash pinned here) into .cache/vllm-source/ (git-ignored; reused when
# present: pip checks the hash and skips the download), only its vllm/**/*.py files are extracted (zipfile; no .so), and
# the tests read them with ast, never importing vllm (HARNESS_VLLM_SOURCE; HARNESS_REQUIRE_VLLM=1 fails instead of
# skipping). -s prints the table of what was verified (docs/guides/vllm.md). The import-mode tests, vLLM's behaviour on
# real objects, stay in the opt-in vllm.sh. PY= picks the Python (default .venv/bin/python, which needs the dev extra).
# Needs network for pip. Prints "leg vllm_source: N s".
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
trap 'echo "leg vllm_source: $((SECONDS - start)) s"' EXIT
py=${PY:-.venv/bin/python}
cache=.cache/vllm-source
wheel=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
mkdir -p "$cache"
echo "vllm==0.33.0 --hash=sha256:4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa" > "$cache/requirement.txt"
"$py" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
  --require-hashes -r "$cache/requirement.txt" -d "$cache"
rm -rf "$cache/src"
"$py" - "$cache/$wheel" "$cache/src" <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
names = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
for name in names:
    wheel.extract(name, sys.argv[2])
print(f"vllm_source leg: {len(names)} .py files of {sys.argv[1]}")
PY
HARNESS_VLLM_SOURCE="$cache/src" HARNESS_REQUIRE_VLLM=1 "$py" -m pytest -q -s -p no:cacheprovider tests/test_vllm_api.py
