"""The parts of the ``swebench`` package (4.1.0) this task uses: specs, test directives, log parsers, grading.

``import swebench`` runs the package's ``__init__``, which imports its dataset collectors, Docker builders and
Modal runner (GitHub, Modal and BeautifulSoup clients). We need none of them, so the two package ``__init__``
modules are skipped and only the submodules below are imported (they need ``requests``, ``datasets``,
``python-dotenv`` and ``unidiff``). No conda script and no GitHub download of swebench is ever run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

SWEBENCH_VERSION = "4.1.0"


class SwebenchMissing(ImportError):
    """The ``swebench`` package (or a module it imports) is not installed."""


@cache
def _package_root() -> Path:
    spec = importlib.util.find_spec("swebench")
    if spec is None or not spec.submodule_search_locations:
        raise SwebenchMissing(f"the swebench package is not installed: pip install swebench=={SWEBENCH_VERSION}")
    return Path(next(iter(spec.submodule_search_locations)))


def module(name: str) -> types.ModuleType:
    """Import ``swebench.<name>`` without running the ``swebench`` and ``swebench.harness`` package ``__init__``s."""
    root = _package_root()
    for pkg, path in (("swebench", root), ("swebench.harness", root / "harness")):
        if pkg not in sys.modules:
            shell = types.ModuleType(pkg)
            shell.__path__ = [str(path)]  # a package whose __init__ was not run
            shell.__version__ = SWEBENCH_VERSION
            sys.modules[pkg] = shell
    try:
        return importlib.import_module(f"swebench.{name}")
    except ModuleNotFoundError as exc:
        dist = {"dotenv": "python-dotenv"}.get(exc.name or "", exc.name)
        raise SwebenchMissing(f"swebench.{name} needs the module {exc.name!r}: pip install {dist}") from exc


def specs() -> dict:
    """``MAP_REPO_VERSION_TO_SPECS``: repo -> version -> spec (test_cmd, install, pre_install, eval_commands, ...)."""
    return module("harness.constants").MAP_REPO_VERSION_TO_SPECS


def spec_of(repo: str, version: str) -> dict:
    """The swebench spec of ``repo`` at ``version``; KeyError naming what is known when there is none."""
    known = specs()
    if repo not in known:
        raise KeyError(f"swebench has no spec for repo {repo!r} (register one with opd_harness.tasks.swebench.upstream.register_repo)")
    if version not in known[repo]:
        raise KeyError(f"swebench has no spec for {repo} version {version!r}; known: {', '.join(sorted(known[repo]))}")
    return known[repo][version]


def parser_of(repo: str) -> Callable[[str, object], dict[str, str]]:
    """swebench's log parser for ``repo`` (``MAP_REPO_TO_PARSER``): log text -> {test name: status}."""
    parsers = module("harness.log_parsers").MAP_REPO_TO_PARSER
    if repo not in parsers:
        raise KeyError(f"swebench has no log parser for repo {repo!r}")
    return parsers[repo]


def test_directives(instance: Mapping) -> list[str]:
    """The test files (django: test modules) that the instance's test patch touches: what the test command runs."""
    return module("harness.test_spec.python").get_test_directives(dict(instance))


def modified_files(patch: str) -> list[str]:
    """Files a diff modifies (swebench's ``get_modified_files``)."""
    return module("harness.utils").get_modified_files(patch)


def clean_requirements(text: str) -> str:
    """swebench's replacements of yanked/renamed packages in a requirements file."""
    return module("harness.test_spec.python").clean_requirements(text)


def requirements_paths(repo: str) -> list[str]:
    """Where a repo keeps its requirements file (``MAP_REPO_TO_REQS_PATHS``), for specs with ``packages: requirements.txt``."""
    return list(module("harness.constants").MAP_REPO_TO_REQS_PATHS.get(repo, []))


def resolution(status_map: Mapping[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> tuple[str, dict]:
    """swebench's decision: (``RESOLVED_FULL`` / ``RESOLVED_PARTIAL`` / ``RESOLVED_NO``, its per-test report)."""
    grading = module("harness.grading")
    gold = {"FAIL_TO_PASS": list(fail_to_pass), "PASS_TO_PASS": list(pass_to_pass)}
    report = grading.get_eval_tests_report(dict(status_map), gold)
    return grading.get_resolution_status(report), report


def register_repo(repo: str, versions: Mapping[str, dict], parser: str | Callable = "django/django") -> None:
    """Add a repository swebench does not know: its specs per version and its log parser (a known repo's name, or a
    function). Used for hand-made instances (tests); an existing entry is left as it is."""
    constants = module("harness.constants")
    constants.MAP_REPO_VERSION_TO_SPECS.setdefault(repo, {}).update(
        {v: dict(s) for v, s in versions.items() if v not in constants.MAP_REPO_VERSION_TO_SPECS.get(repo, {})}
    )
    constants.MAP_REPO_TO_EXT.setdefault(repo, "py")
    parsers = module("harness.log_parsers").MAP_REPO_TO_PARSER
    parsers.setdefault(repo, parsers[parser] if isinstance(parser, str) else parser)
