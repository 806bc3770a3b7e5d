"""pyproject's requirements name only extras their packages provide, spelled as pip compares them (no warning on install)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
DECLARED = [*PYPROJECT["dependencies"], *(r for group in PYPROJECT["optional-dependencies"].values() for r in group)]
REQUIREMENTS = [Requirement(r) for r in DECLARED if not r.startswith("opd-harness")]


def unprovided_extras(requirement: Requirement, depth: int = 3) -> list[str]:
    """``package[extra]`` names, this requirement's and those its extras pull in, that the installed package does not provide."""
    try:
        meta = importlib.metadata.metadata(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return []  # an optional integration not installed here (e.g. vllm)
    provided = set(meta.get_all("Provides-Extra") or [])
    missing = [f"{requirement.name}[{extra}]" for extra in sorted(requirement.extras) if extra not in provided]
    if depth:
        for line in meta.get_all("Requires-Dist") or []:
            pulled = Requirement(line)
            active = requirement.extras & provided or {""}
            if pulled.extras and (pulled.marker is None or any(pulled.marker.evaluate({"extra": e}) for e in active)):
                missing += unprovided_extras(pulled, depth - 1)
    return missing


def test_every_named_extra_is_provided_verbatim():
    assert [missing for requirement in REQUIREMENTS for missing in unprovided_extras(requirement)] == []


def test_the_extra_check_catches_a_misspelt_extra():
    assert unprovided_extras(Requirement("math-verify[antlr4_13_2]==0.9.0")) == ["math-verify[antlr4_13_2]"]
    assert unprovided_extras(Requirement("math-verify[antlr4-13-2]==0.9.0")) == ["latex2sympy2_extended[antlr4_13_2]"]
