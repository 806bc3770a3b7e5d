"""Write requirements/ci.lock, the exact versions CI installs, from a fresh resolution of the declared ranges.

The package declares ranges (pyproject.toml); CI applies this lock as a pip constraints file so that every run gets the
same versions. Run it to move the lock forward (newest versions the ranges and the machine's indexes allow), then run
.ci/run; a lower bound in pyproject.toml that the lock leaves behind is raised by hand (tests/test_packaging.py says which).

    python3 .ci/lock.py              # resolves `torch==2.13.0 -e '.[dev,docs]'` for this Python, rewrites the lock
    python3 .ci/lock.py --keep       # the same, preferring the versions already locked (adds what is missing)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

try:
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare python3: pip vendors the same module
    from pip._vendor.packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "ci.lock"
EXTRAS = "dev,docs"  # what CI installs; bench (protobuf<5) and vllm (its own torch) are environments of their own
HEADER = f"""\
# The exact versions CI installs (a pip constraints file): pip install -c requirements/ci.lock torch==2.13.0 -e '.[{EXTRAS}]'.
# pyproject.toml declares ranges; this file pins one tested point inside them. Written by .ci/lock.py from a pip
# resolution report; edit by hand only to move one package. Not for the `bench` and `vllm` extras (their own environments).
"""


def lock_lines(report: dict) -> list[str]:
    """``name==version`` for every distribution a pip ``--report`` would install, this project left out, sorted by name.

    A local version label (``2.13.0+cpu``) is dropped: ``torch==2.13.0`` then admits the CPU wheel and the CUDA one alike,
    so the same lock serves every Python (the CPU wheel exists only for 3.11 here)."""
    pins = {}
    for item in report["install"]:
        meta = item["metadata"]
        name = meta["name"]
        if name.lower().replace("_", "-") == "opd-harness":
            continue
        pins[name.lower()] = f"{name}=={meta['version'].split('+')[0]}"
    return [pins[key] for key in sorted(pins)]


def oldest_python() -> str:
    """The oldest Python the package admits (``requires-python = ">=3.11"`` gives ``3.11.0``)."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floors = [s.version for s in SpecifierSet(spec) if s.operator == ">="]
    assert len(floors) == 1, f"requires-python {spec!r}: expected one >= bound"
    return ".".join((floors[0].split(".") + ["0", "0"])[:3])


def excluded_by_python(report: dict, python: str) -> list[str]:
    """Entries of a pip ``--report`` whose Requires-Python refuses ``python``.

    The lock is resolved on the machine's own Python (3.11.7 here), so pip may pick releases that refuse an older patch
    release the package admits (pymdown-extensions 13 and soupsieve 3+ need 3.11.5; Debian bookworm ships 3.11.2); the
    lock must install on every Python the package admits, and resolve.sh checks 3.11.0."""
    out = []
    for item in report["install"]:
        meta = item["metadata"]
        requires = meta.get("requires_python")
        if requires and not SpecifierSet(requires).contains(python):
            out.append(f"{meta['name']}=={meta['version']} (Requires-Python {requires})")
    return sorted(out)


def resolve(keep: bool) -> dict:
    """pip's resolution report of CI's install command in a fresh environment (nothing is installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", str(report)]
        if keep and LOCK.exists():
            cmd += ["-c", str(LOCK)]
        subprocess.run([*cmd, "torch==2.13.0", "-e", f".[{EXTRAS}]"], cwd=ROOT, check=True)
        return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="prefer the versions already locked")
    args = parser.parse_args()
    report = resolve(args.keep)
    python = oldest_python()
    if refused := excluded_by_python(report, python):
        sys.exit(f"not written: these releases refuse Python {python}, which the package admits: {', '.join(refused)}. "
                 "Pin the newest release that installs there in requirements/ci.lock by hand and run with --keep.")
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text(HEADER + "\n".join(lock_lines(report)) + "\n")
    print(f"wrote {LOCK.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
