"""Which test-run sections of setup.cfg / pyproject.toml a model patch changed (the tampering guard's per-section half).

Run in the grading container, after the model patch is applied and before any code of the repository runs, with the
base interpreter in isolated mode (``python3 -I -S steering.py PATH...``, standard library only): for each path it
compares the sections that steer a test run (``[tool:pytest]``/``[pytest]``, ``[tool.pytest...]``, pytest11 entry
points) in the base commit (``git cat-file``, hooks off) and in the work tree, and prints each path whose sections
differ. A file that does not parse on either side counts as changed when its text differs.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib

CFG_SECTIONS = ("tool:pytest", "pytest", "coverage:run")
ENTRY_GROUP = "pytest11"


def cfg_sections(text: str) -> dict:
    """setup.cfg's test sections and its pytest11 entry points."""
    import configparser  # with the first setup.cfg: `harness tasks` does not load it

    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.read_string(text)
    out = {name: dict(parser[name]) for name in parser.sections() if name in CFG_SECTIONS}
    if parser.has_option("options.entry_points", ENTRY_GROUP):
        out["options.entry_points"] = parser.get("options.entry_points", ENTRY_GROUP)
    return out


def toml_sections(text: str) -> dict:
    """pyproject.toml's ``[tool.pytest*]`` tables and its pytest11 entry points."""
    doc = tomllib.loads(text)
    tool = doc.get("tool", {}) if isinstance(doc.get("tool"), dict) else {}
    project = doc.get("project", {}) if isinstance(doc.get("project"), dict) else {}
    entry = project.get("entry-points", {}) if isinstance(project.get("entry-points"), dict) else {}
    return {"tool.pytest": tool.get("pytest"), "entry-points": entry.get(ENTRY_GROUP)}


def test_sections(path: str, text: str) -> dict:
    return toml_sections(text) if path.endswith(".toml") else cfg_sections(text)


def changed(path: str, base: str | None, now: str | None) -> bool:
    """Whether the test-run sections of ``path`` differ between ``base`` and ``now`` (None: the file is absent)."""
    if base == now:
        return False
    import configparser

    try:
        return test_sections(path, base or "") != test_sections(path, now or "")
    except (configparser.Error, tomllib.TOMLDecodeError, ValueError):
        return True


def base_text(path: str) -> str | None:
    proc = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "cat-file", "blob", f"HEAD:{path}"], capture_output=True)
    return proc.stdout.decode("utf-8", errors="replace") if proc.returncode == 0 else None


def work_text(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def main(paths: list[str]) -> int:
    for path in paths:
        if changed(path, base_text(path), work_text(path)):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
