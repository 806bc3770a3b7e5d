"""The layers hold: every import of every module in the project's packages (top-level and inside functions, relative
ones, ``importlib.import_module("literal")``) obeys the folder table of docs/architecture.md, and no modules import
each other in a circle.

The table's "imports of ours" column is the rule's only source: a package's row names, as backticked folders
(`` `sandbox/` ``), the packages it may import besides itself; a row that names none imports nothing of ours.
An ``import_module`` call with a literal name is an import whose target is fixed when the code is written, so it
counts; a name computed at run time (a registry's entry point, an f-string) is data, not an import.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
FOLDER = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)/`")  # a backticked folder name: `harness/`
IMPORTERS = {"import_module", "__import__"}  # importlib.import_module("x"), import_module("x"), __import__("x")


@dataclass(frozen=True)
class Import:
    """One import statement (or literal import_module call) of one module, resolved to a module of ours."""

    source: str  # the importing module, e.g. opd_harness.cli
    target: str  # the imported module, e.g. opd_harness.store
    where: str  # path:line of the statement
    statement: str  # the statement as written
    layers: tuple[str, str] = ("", "")  # the top-level folders of source and target, e.g. ("harness", "sandbox")


def import_names(root: Path) -> dict[str, str]:
    """Folder -> the import name it is installed as: pyproject's ``[tool.setuptools] package-dir`` inverted (``harness``
    -> ``opd_harness``, ``tasks`` -> ``opd_harness.tasks``); a folder it does not name is imported under its own name."""
    pyproject = root / "pyproject.toml"
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"] if pyproject.is_file() else {}
    return {folder: name for name, folder in table.get("package-dir", {}).items()}


def package_modules(root: Path, packages: list[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted import name -> file (a package is its ``__init__.py``)."""
    names, modules = import_names(root), {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            parts = (*names.get(parts[0], parts[0]).split("."), *parts[1:])
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _layer(path: Path, root: Path) -> str:
    """The top-level folder a module's file lies in: its row of the folder table."""
    return path.relative_to(root).parts[0]


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _literal_import(node: ast.Call) -> str | None:
    """The module a call ``import_module("x")`` / ``importlib.import_module("x")`` / ``__import__("x")`` names, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (resolving ``from . import x`` and ``from ..a import b``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest dotted prefix that is a module of ours (``opd_harness.store.Store`` -> ``opd_harness.store``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def module_imports(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Import]:
    """Every import of ours in ``path``, wherever it stands in the file (module level, functions, methods, branches)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)):
            names = [literal]
        else:
            continue
        where = f"{path.relative_to(root)}:{node.lineno}"
        for target in dict.fromkeys(t for name in names if (t := _ours(name, modules)) and t != module):
            found.append(Import(module, target, where, ast.unparse(node), (_layer(path, root), _layer(modules[target], root))))
    return sorted(found, key=lambda i: int(i.where.rsplit(":", 1)[1]))  # in line order (ast.walk is breadth first)


def module_names_in_strings(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Import]:
    """Each string that is exactly the name of a module of ours, or ``module:object`` (a registry's list of built-ins):
    an import made later by name, which the table rules like one. Not counted for circles (nothing is imported yet)."""
    found, imported = [], set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Call) and _literal_import(node):
            imported.add(id(node.args[0]))  # an import, read by module_imports
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (name := node.value.split(":")[0]) in modules:
            if "." in name and name != module and id(node) not in imported:  # a dotted name: 'tasks' alone is also a word
                layers = (_layer(path, root), _layer(modules[name], root))
                found.append(Import(module, name, f"{path.relative_to(root)}:{node.lineno}", repr(node.value), layers))
    return found


def folder_rules(architecture: str) -> dict[str, set[str]]:
    """The folder table of docs/architecture.md: folder -> the folders its "imports of ours" column names."""
    section = architecture.split("\n## Folders", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0]]
    column = header.index("imports of ours")
    rules = {}
    for cells in rows[2:]:  # after the header and its --- row
        folder = FOLDER.fullmatch(cells[0].strip())
        if folder:
            rules[folder.group(1)] = set(FOLDER.findall(cells[column]))
    return rules


def layer_violations(imports: list[Import], rules: dict[str, set[str]]) -> list[str]:
    """Each import from a package into one its row does not name."""
    return [
        f"{i.where}: `{i.statement}`: {i.source} ({layer}/) imports {i.target} ({target}/); {layer}/ may import "
        + (", ".join(f"{name}/" for name in sorted(rules[layer])) or "nothing of ours")
        for i in imports
        if (layer := i.layers[0]) != (target := i.layers[1]) and target not in rules[layer]
    ]


def _reachable(graph: dict[str, dict[str, Import]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), {}):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _path(graph: dict[str, dict[str, Import]], start: str, goal: str, within: set[str]) -> list[Import]:
    """The shortest chain of imports from ``start`` to ``goal`` through modules of ``within`` (breadth first)."""
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, edge in graph.get(node, {}).items():
                if nxt in within and nxt not in came:
                    came[nxt] = edge
                    following.append(nxt)
        if goal in came:
            break
        frontier = following
    chain, node = [], goal
    while True:
        chain.append(came[node])
        node = came[node].source
        if node == start:
            return chain[::-1]


def import_cycles(imports: list[Import]) -> list[str]:
    """Each set of modules that import each other in a circle (a strongly connected component), shown as one circle."""
    graph: dict[str, dict[str, Import]] = {}
    for i in imports:
        graph.setdefault(i.source, {}).setdefault(i.target, i)
    reach = {module: _reachable(graph, module) for module in graph}
    cycles, placed = [], set()
    for module in sorted(graph):
        if module in placed or module not in reach[module]:
            continue
        component = {m for m in reach[module] if module in reach.get(m, ())}
        placed |= component
        chain = _path(graph, module, module, component)
        steps = " -> ".join(f"{edge.target} ({edge.where}: `{edge.statement}`)" for edge in chain)
        cycles.append(f"import cycle among {', '.join(sorted(component))}: {module} -> {steps}")
    return cycles


def project_imports(root: Path, packages: list[str], reader=module_imports) -> list[Import]:
    """What ``reader`` finds in every module of ``packages`` (by default: their imports)."""
    modules = package_modules(root, packages)
    return [i for module, path in modules.items() for i in reader(module, path, modules, root)]


def checked_packages(root: Path) -> list[str]:
    """The top-level Python packages of the project (folders with an ``__init__.py``)."""
    return sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


# ---- the project ------------------------------------------------------------------------------


def test_every_package_has_a_row_in_the_folder_table():
    rules = folder_rules(ARCHITECTURE.read_text(encoding="utf-8"))
    assert set(checked_packages(ROOT)) <= set(rules), "docs/architecture.md's folder table lacks a row for a package"
    assert rules["sandbox"] == set(), "sandbox/ imports nothing of ours"


def test_imports_follow_the_folder_table():
    rules = folder_rules(ARCHITECTURE.read_text(encoding="utf-8"))
    violations = layer_violations(project_imports(ROOT, checked_packages(ROOT)), rules)
    assert violations == [], "imports the folder table of docs/architecture.md does not allow:\n" + "\n".join(violations)


def test_strings_name_no_module_a_package_may_not_import():
    rules = folder_rules(ARCHITECTURE.read_text(encoding="utf-8"))
    violations = layer_violations(project_imports(ROOT, checked_packages(ROOT), module_names_in_strings), rules)
    assert violations == [], "module names in strings the folder table does not allow:\n" + "\n".join(violations)


def test_no_import_cycles():
    cycles = import_cycles(project_imports(ROOT, checked_packages(ROOT)))
    assert cycles == [], "\n".join(cycles)


# ---- the checker itself, on a tree made here -------------------------------------------------

TABLE = """# Architecture

## Folders

| folder | owns | imports of ours |
|---|---|---|
| `low/` | the bottom | nothing of ours |
| `mid/` | the middle | `low/` only |
| `top/` | the top | `mid/`, `low/` |
| `docs/` | prose | — |

## Next
"""


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Three packages: every kind of import the checker reads, one layer violation of each kind, one circle."""
    return _tree(tmp_path, {
        "low/__init__.py": "",
        "low/base.py": "def f():\n    import importlib\n    return importlib.import_module('top')\n",  # violation (literal)
        "low/util.py": "BUILTINS = ('low.base', 'top.app:App')  # the second is refused\n",
        "mid/__init__.py": "from . import core\n",
        "mid/core.py": "from ..low import util\nfrom low.base import f\n\n\ndef g():\n    import top  # a violation\n",
        "mid/a.py": "import mid.b\n",
        "mid/b.py": "class B:\n    def m(self):\n        from .a import thing\n",  # mid.a <-> mid.b, inside a method
        "top/__init__.py": "",
        "top/app.py": "import low.util\nfrom mid import core\nimport json\n",
    })


def test_the_folder_table_is_read_from_its_column():
    assert folder_rules(TABLE) == {"low": set(), "mid": {"low"}, "top": {"mid", "low"}, "docs": set()}


def test_the_checker_finds_every_import_kind_and_each_violation(tree):
    imports = project_imports(tree, checked_packages(tree))
    edges = {(i.source, i.target) for i in imports}
    assert {("mid", "mid.core"), ("mid.core", "low.util"), ("mid.core", "low.base"), ("top.app", "low.util")} <= edges
    assert ("top.app", "mid.core") in edges
    assert not any(i.target == "json" for i in imports)  # only modules of ours
    violations = layer_violations(imports, folder_rules(TABLE))
    assert len(violations) == 2
    assert violations[0] == (
        "low/base.py:3: `importlib.import_module('top')`: low.base (low/) imports top (top/); low/ may import nothing of ours"
    )
    assert violations[1] == "mid/core.py:6: `import top`: mid.core (mid/) imports top (top/); mid/ may import low/"


def test_the_checker_finds_a_circle_through_a_function_level_import(tree):
    (cycle,) = import_cycles(project_imports(tree, checked_packages(tree)))
    assert cycle == (
        "import cycle among mid.a, mid.b: mid.a -> mid.b (mid/a.py:1: `import mid.b`)"
        " -> mid.a (mid/b.py:3: `from .a import thing`)"
    )


def test_the_checker_finds_a_module_named_in_a_string(tree):
    named = project_imports(tree, checked_packages(tree), module_names_in_strings)
    assert [(i.source, i.target) for i in named] == [("low.util", "low.base"), ("low.util", "top.app")]
    (violation,) = layer_violations(named, folder_rules(TABLE))
    assert violation == "low/util.py:1: `'top.app:App'`: low.util (low/) imports top.app (top/); low/ may import nothing of ours"


def test_a_longer_circle_is_one_component(tmp_path):
    root = _tree(tmp_path, {"p/__init__.py": "", "p/x.py": "import p.y\n", "p/y.py": "import p.z\n", "p/z.py": "import p.x\n"})
    (cycle,) = import_cycles(project_imports(root, ["p"]))
    assert cycle.startswith("import cycle among p.x, p.y, p.z: p.x -> p.y (p/x.py:1") and cycle.count(" -> ") == 3
