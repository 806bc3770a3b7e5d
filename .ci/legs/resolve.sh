#!/usr/bin/env bash
# Resolution leg: pip resolves the package, binary wheels only, for CPython 3.11, 3.12 and 3.13 (the lock's versions,
# the dev and docs extras, torch 2.13.0) and resolves the vllm extra (vLLM 0.33 with the torch and transformers it pins;
# no lock: the lock is the CPU environment's). Nothing is installed (--dry-run). The four resolutions run in parallel:
# they wait on the package indexes, not on the CPU. Needs network for pip. Prints "leg resolve: N s".
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
trap 'echo "leg resolve: $((SECONDS - start)) s"' EXIT
work=$(mktemp -d /tmp/opd-resolve-leg.XXXXXX)
python3 -m venv "$work/venv"
pip=$work/venv/bin/pip
# One pip for every run (the resolver's behaviour is part of the check). --python-version 3.11 means 3.11.0, the oldest
# Python the package admits: a lock entry whose Requires-Python wants a later patch release fails here (pymdown-extensions
# 13 and soupsieve 4 need 3.11.5; .ci/lock.py now refuses them).
"$pip" install -q pip==26.3 2>&1 | grep -v "is ignored" || true
.ci/sdist_wheels.sh "$pip" "$work/wheels"   # --only-binary=:all: needs wheels for the three sdist-only lock entries

# check NAME PIP-ARGS...: one dry-run resolution; prints what it would install, or pip's conflict.
check() {
  local name=$1; shift
  if "$pip" install --dry-run --ignore-installed --only-binary=:all: --report "$work/$name.json" "$@" > "$work/$name.log" 2>&1; then
    python3 - "$work/$name.json" "$name" <<'PY'
import json, sys
pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
picked = " ".join(f"{n} {pins[n]}" for n in ("torch", "transformers", "numpy", "vllm") if n in pins)
print(f"  resolve {sys.argv[2]}: ok, {len(pins)} distributions ({picked})")
PY
  else
    echo "  resolve $name: FAILED"; grep -v "is ignored" "$work/$name.log" | grep -A 20 -E "conflict is caused|^ERROR" | head -n 40; return 1
  fi
}
pids=()
for version in 3.11 3.12 3.13; do
  check "py$version" --python-version "$version" --target "$work/target-$version" --find-links "$work/wheels" \
    -c requirements/ci.lock torch==2.13.0 '.[dev,docs]' &
  pids+=($!)
done
check vllm '.[vllm]' &
pids+=($!)
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
rm -rf "$work"
exit $status
