"""The wheel's layout: one import name (``opd_harness``) made of the repository's top-level folders, as pyproject's
``[tool.setuptools]`` maps them; a folder with an ``__init__.py`` that the list misses would be left out of the wheel.
The dependencies: ranges in pyproject.toml, the exact versions CI installs in requirements/ci.lock."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def folder_packages(package_dir: dict[str, str]) -> set[str]:
    """The import name of every folder under a mapped folder that holds an ``__init__.py``."""
    names = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((name, *rel)))
    return names


def test_one_top_level_import_name():
    table = setuptools_table()
    assert {name.split(".")[0] for name in table["packages"]} == {"opd_harness"}
    assert {name.split(".")[0] for name in table["package-dir"]} == {"opd_harness"}


def test_every_package_folder_is_in_the_wheel():
    table = setuptools_table()
    assert set(table["packages"]) == folder_packages(table["package-dir"])


def test_every_top_level_package_folder_is_mapped():
    """A new top-level folder with an ``__init__.py`` must be given its place under opd_harness, not shipped on its own."""
    mapped = set(setuptools_table()["package-dir"].values())
    top = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top == mapped


# --- ranges in the package, pins in the lock -------------------------------------------------------------------------------

LOCK = ROOT / "requirements" / "ci.lock"
# Extras CI installs from the lock (dev pulls ray, lmeval and tracking). The others are environments of their own: bench's
# evalplus needs protobuf<5 (google-generativeai), which the trackers' protobuf 7 excludes; vllm pins its own torch.
LOCKED_EXTRAS = ("dev", "ray", "lmeval", "tracking", "docs")
UNLOCKED_EXTRAS = {"bench": "evalplus needs protobuf<5", "vllm": "vLLM 0.33 pins torch 2.14.0", "gpu": "alias of vllm"}
# Lower bounds set by another CI leg than the lock's: vLLM 0.33 needs transformers>=5.16.1,<5.21 and (through
# mistral-common) numpy<2.4, and its leg runs the backend, rollout and learner tests with those.
OTHER_LEG_BOUNDS = {"transformers": "the vLLM leg", "numpy": "the vLLM leg (mistral-common caps numpy<2.4 on Python <= 3.12)"}


def project_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared(extras: tuple[str, ...] | None = None) -> list[Requirement]:
    """[project.dependencies] and the named extras (all when None), without the project's own extras (opd-harness[...])."""
    project = project_table()
    groups = project["optional-dependencies"]
    lines = [*project["dependencies"], *(r for name in (groups if extras is None else extras) for r in groups[name])]
    return [req for req in map(Requirement, lines) if canonicalize_name(req.name) != "opd-harness"]


def exact_pins(requirements: list[Requirement]) -> list[str]:
    """The requirements that pin one version (``==X`` without a wildcard, or ``===X``) instead of declaring a range."""
    return [str(r) for r in requirements for s in r.specifier
            if s.operator == "===" or (s.operator == "==" and not s.version.endswith(".*"))]


def lock_pins() -> dict[str, Version]:
    """The lock's ``name==version`` lines by canonical name; any other kind of line fails here."""
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and not req.marker and not req.extras, f"{LOCK.name}:{number}: not name==version: {line}"
        assert canonicalize_name(req.name) not in pins, f"{LOCK.name}:{number}: {req.name} locked twice"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def lower_bound(requirement: Requirement) -> Version | None:
    return max((Version(s.version) for s in requirement.specifier if s.operator in (">=", "~=")), default=None)


def test_declared_dependencies_are_ranges_not_pins():
    assert exact_pins(declared()) == []


def test_the_pin_check_catches_a_pin():
    reqs = [Requirement(r) for r in ("torch==2.13.0", "numpy>=2.4", "vllm>=0.33,<0.34", "x===1.0", "y==2.*", "z[a]==1")]
    assert exact_pins(reqs) == ["torch==2.13.0", "x===1.0", "z[a]==1"]


def test_every_extra_is_either_locked_or_says_why_not():
    assert set(project_table()["optional-dependencies"]) == set(LOCKED_EXTRAS) | set(UNLOCKED_EXTRAS)


def test_the_lock_covers_every_declared_dependency_inside_its_range():
    pins = lock_pins()
    missing = [str(r) for r in declared(LOCKED_EXTRAS) if canonicalize_name(r.name) not in pins]
    outside = [f"{r} (locked {pins[canonicalize_name(r.name)]})" for r in declared(LOCKED_EXTRAS)
               if canonicalize_name(r.name) in pins and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert (missing, outside) == ([], [])


def test_each_lower_bound_is_a_version_ci_tests():
    """A lower bound below the locked version claims support no leg checks; raise it when the lock moves on."""
    pins = lock_pins()
    untested = [f"{r} (locked {pins[canonicalize_name(r.name)]})" for r in declared(LOCKED_EXTRAS)
                if canonicalize_name(r.name) not in OTHER_LEG_BOUNDS and lower_bound(r) != pins[canonicalize_name(r.name)]]
    assert untested == []


def test_the_vllm_extra_admits_vllm_0_33_and_gpu_is_its_alias():
    groups = project_table()["optional-dependencies"]
    (vllm,) = map(Requirement, groups["vllm"])
    assert vllm.name == "vllm" and vllm.specifier.contains("0.33.0") and not vllm.specifier.contains("0.34.0")
    assert groups["gpu"] == ["opd-harness[vllm]"]
    # what vLLM 0.33.0 itself pins must lie inside the package's ranges, or the extra cannot resolve
    ranges = {canonicalize_name(r.name): r.specifier for r in declared([])}
    assert ranges["torch"].contains("2.14.0") and ranges["transformers"].contains("5.16.1") and ranges["transformers"].contains("5.20.2")
    assert ranges["numpy"].contains("2.3.5")  # what vLLM 0.33's resolution gets on Python 3.11 and 3.12


def test_python_3_11_to_3_13_are_admitted_and_listed():
    project = project_table()
    assert all(SpecifierSet(project["requires-python"]).contains(v) for v in ("3.11.0", "3.12.0", "3.13.0"))
    assert {f"Programming Language :: Python :: 3.{minor}" for minor in (11, 12, 13)} <= set(project["classifiers"])


def test_readme_and_ci_install_with_the_lock():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    installs = [line for text in (readme, ci) for line in text.splitlines() if "pip install" in line and "torch==2.13.0" in line]
    assert len(installs) == 4  # README's two commands; .ci/run's docs install and README command (2)
    assert installs and all("-c requirements/ci.lock" in line for line in installs)


def test_every_ci_leg_script_is_called_from_ci_run():
    called = {line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    legs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / ".ci" / "legs").glob("*.sh"))
    assert legs and [leg for leg in legs if leg not in called] == []


def lock_writer():
    spec = importlib.util.spec_from_file_location("ci_lock", ROOT / ".ci" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_writer_drops_the_project_and_local_labels():
    module = lock_writer()
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in
                          (("torch", "2.13.0+cpu"), ("opd-harness", "0.1.0"), ("Babel", "2.1"), ("aiohttp", "3.14.5"))]}
    assert module.lock_lines(report) == ["aiohttp==3.14.5", "Babel==2.1", "torch==2.13.0"]


def test_the_lock_writer_refuses_releases_that_the_oldest_admitted_python_cannot_install():
    """Resolved on 3.11.7, pip picked soupsieve 4.1.4 and pymdown-extensions 13.1.2 (Requires-Python >=3.11.5), which
    made the lock fail on Debian bookworm's 3.11.2 and in resolve.sh's 3.11 check."""
    module = lock_writer()
    assert module.oldest_python() == "3.11.0"
    report = {"install": [{"metadata": {"name": n, "version": v, **({"requires_python": r} if r else {})}} for n, v, r in
                          (("soupsieve", "4.1.4", ">=3.11.5"), ("soupsieve", "2.10", ">=3.9"), ("torch", "2.13.0", None),
                           ("numpy", "2.4.6", ">=3.11"), ("future", "9.0", ">=3.12"))]}
    assert module.excluded_by_python(report, "3.11.0") == ["future==9.0 (Requires-Python >=3.12)",
                                                            "soupsieve==4.1.4 (Requires-Python >=3.11.5)"]
    assert module.excluded_by_python(report, "3.12.1") == []


def test_every_data_file_of_the_packages_is_in_the_wheel():
    """Presets, recipes, protocols and the viewer's assets are read at run time: each non-Python file in a package folder
    must match a package-data glob, or the installed wheel lacks it."""
    table = setuptools_table()
    shipped = set()
    for package, globs in table["package-data"].items():
        base = ROOT / table["package-dir"][package]
        shipped |= {p for pattern in globs for p in base.glob(pattern) if p.is_file()}
    data = {p for folder in table["package-dir"].values() for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert sorted(str(p.relative_to(ROOT)) for p in data - shipped) == []
