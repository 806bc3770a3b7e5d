#!/usr/bin/env bash
# Wheel leg: `python -m build` makes the sdist and, from it, the wheel; the wheel goes into a fresh virtualenv outside the
# checkout (the lock's versions, the CPU torch) beside another project that has its own top-level `tasks` package. Both
# must import, and the installed `harness` must answer --version, list the tasks and run the smoke preset there (so the
# presets, recipes, protocols and viewer assets are in the wheel, and nothing reads the checkout).
# Needs .venv with the dev extra (README command 2; `build` is in it). Prints "leg wheel: N s".
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
start=$SECONDS
trap 'echo "leg wheel: $((SECONDS - start)) s"' EXIT
work=$(mktemp -d /tmp/opd-wheel-leg.XXXXXX)

.venv/bin/python -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/opd_harness-*.whl)
# One top-level name in the wheel: opd_harness/ and its .dist-info, nothing else.
top=$(.venv/bin/python -c "import sys, zipfile; print(' '.join(sorted({n.split('/')[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()})))" "$wheel")
case "$top" in "opd_harness opd_harness-"*".dist-info") ;; *) echo "the wheel installs more than opd_harness: $top"; exit 1 ;; esac

# Another project with a generic `tasks` package of its own.
mkdir -p "$work/other/tasks"
printf '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n[project]\nname = "other-project"\nversion = "1.0"\n[tool.setuptools]\npackages = ["tasks"]\n' > "$work/other/pyproject.toml"
echo 'OWNER = "other-project"' > "$work/other/tasks/__init__.py"

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-compile -c requirements/ci.lock torch==2.13.0 "$wheel" "$work/other"   # --no-compile: as in newer_python.sh
cd "$work"   # outside the checkout: only the installed wheel can be imported
venv/bin/python - "$root" <<'PY'
import sys
from pathlib import Path

import opd_harness
import opd_harness.tasks
import tasks

root = Path(sys.argv[1])
assert tasks.OWNER == "other-project", tasks.__file__
for module in (opd_harness, opd_harness.tasks, tasks):
    assert "site-packages" in module.__file__ and not Path(module.__file__).is_relative_to(root), module.__file__
print(f"both import: tasks from {tasks.__file__}, opd_harness.tasks from {opd_harness.tasks.__file__}")
PY
venv/bin/harness --version
venv/bin/harness tasks > tasks.txt && grep -q '^arith\b' tasks.txt || { cat tasks.txt; echo "harness tasks does not list arith"; exit 1; }
HF_HUB_OFFLINE=1 venv/bin/harness run --preset smoke > smoke.log 2>&1 || { tail -n 40 smoke.log; exit 1; }
tail -n 3 smoke.log
rm -rf "$work"
