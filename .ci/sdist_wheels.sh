#!/usr/bin/env bash
# Usage: sdist_wheels.sh PIP DIR. Builds wheels into DIR for the requirements/ci.lock entries that are published only as
# sdists (pure Python: rouge-score, sqlitedict, word2number, all pulled by lm-eval), so that `pip --python-version X
# --only-binary=:all:` (resolve.sh, newer_python.sh) can resolve the dev extra. A helper of those legs, not a leg.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=$1 dir=$2
mkdir -p "$dir"
pins=$(grep -E -i '^(rouge[-_]score|sqlitedict|word2number)==' requirements/ci.lock)
# shellcheck disable=SC2086
"$pip" wheel -q --no-deps -w "$dir" $pins 2>&1 | grep -v "is ignored" || true
for pin in $pins; do ls "$dir/$(echo "${pin%%==*}" | tr - _)-${pin##*==}-py3-none-any.whl" > /dev/null; done
