"""The wheel's layout: one import name (``opd_harness``) made of the repository's top-level folders, as pyproject's
``[tool.setuptools]`` maps them; a folder with an ``__init__.py`` that the list misses would be left out of the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
