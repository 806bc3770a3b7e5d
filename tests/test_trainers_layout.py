"""The training loop is one module that knows its executors only by registry name: no import cycles among
``trainers`` modules (imports inside functions count too), and mode/executor are decided in one place."""

import ast
from pathlib import Path

from opd_harness.registry import EXECUTORS, PIPELINES

TRAINERS = Path(__file__).resolve().parents[1] / "trainers"


def imported_trainer_modules(path: Path) -> set[str]:
    """``opd_harness.trainers.*`` modules (not objectives) that ``path`` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module]
            if isinstance(node, ast.ImportFrom) and node.module
            else [a.name for a in getattr(node, "names", [])]
            if isinstance(node, ast.Import)
            else []
        )
        found |= {n for n in names if n.startswith("opd_harness.trainers.") and not n.startswith("opd_harness.trainers.objectives")}
    return found


def test_no_import_cycle_among_trainer_modules():
    graph = {f"trainers.{p.stem}": imported_trainer_modules(p) for p in TRAINERS.glob("*.py")}
    visiting, done = set(), set()

    def visit(module: str, chain: list[str]) -> None:
        assert module not in visiting, "import cycle: " + " -> ".join(chain + [module])
        if module in done:
            return
        visiting.add(module)
        for dep in graph.get(module, ()):
            visit(dep, chain + [module])
        visiting.discard(module)
        done.add(module)

    for module in graph:
        visit(module, [])


def test_sync_and_async_are_one_pipeline_and_executors_are_registered():
    assert type(PIPELINES.get("sync")) is type(PIPELINES.get("async"))
    assert {"inprocess", "ray"} <= set(EXECUTORS.names())
    loop_imports = imported_trainer_modules(TRAINERS / "loop.py")
    # executors are looked up by name, never imported by the loop
    assert loop_imports == {"opd_harness.trainers.pipeline", "opd_harness.trainers.guards"}
