"""docs/extending/add-a-task.md's agentic worked example, run as written: its code block becomes a module, is registered as a task
and plays scripted shell-agent episodes in the local sandbox, graded by its check run in each episode's session."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from opd_harness.backends import SamplingParams
from opd_harness.backends.replay import ReplayBackend
from opd_harness.evaluation import evaluate_task
from opd_harness.registry import TASKS
from opd_harness.task import DataError

README = Path(__file__).resolve().parents[1] / "docs" / "extending" / "add-a-task.md"
NAME = "fix_script"
BUGGY = "def add(a, b):\n    return a - b\n"
CHECK = "from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n"


def readme_example() -> str:
    """The first python block of the page's "An agentic task" section."""
    section = README.read_text().split("\n## An agentic task\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def bash(command: str) -> str:
    return f"THOUGHT: next step.\n\n```bash\n{command}\n```"


@pytest.fixture
def task_class(tmp_path):
    """The README's module written to tmp_path, imported, and registered under NAME (removed again afterwards)."""
    module_path = tmp_path / "fix_script_task.py"
    module_path.write_text(readme_example())
    spec = importlib.util.spec_from_file_location("fix_script_task", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    TASKS.add(NAME, module.FixScriptTask)
    try:
        yield TASKS.get(NAME)
    finally:
        TASKS._items.pop(NAME, None)


def write_rows(data_dir: Path, rows: list[dict]) -> None:
    (data_dir / NAME).mkdir(parents=True)
    (data_dir / NAME / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_readme_example_runs_scripted_agents_end_to_end(task_class, tmp_path):
    row = {"question": "check.py fails. Fix calc.py so that `python3 check.py` passes.", "files": {"calc.py": BUGGY, "check.py": CHECK},
           "check": "check.py"}  # fmt: skip
    write_rows(tmp_path / "data", [{"id": f"add-{i}", **row} for i in range(3)])
    opts = task_class.Options(sandbox="local", sandbox_options={"network_isolation": "auto"}, command_timeout_s=20)
    with task_class(opts) as task:
        problems = task.load("test", data_dir=tmp_path / "data")
        done = task.submit_word
        # the fix changes calc.py's size: same size in the same second, Python would reuse the first run's stale .pyc
        scripts = [
            [bash("python3 check.py"), bash("sed -i 's/a - b/a + b  # fixed/' calc.py && python3 check.py"), bash(f"echo {done}")],
            [bash("printf 'print(1)\\n' > check.py && python3 check.py"), bash(f"echo {done}")],  # edits the checker
            ["I cannot do this."] * 3,  # no command: three format errors end it, and the untouched script fails its check
        ]
        replay = ReplayBackend({(task.name, p.id): [turns] for p, turns in zip(problems, scripts, strict=True)})
        result = evaluate_task(replay, task, problems, k=1, sampling=SamplingParams(), n_resamples=100)
    assert [s.status for s in result.samples] == ["pass", "fail", "fail"]
    first = result.trajectories[0]
    assert "AssertionError" in first.segments[1].text and "<returncode>0</returncode>" in first.segments[3].text
    assert json.loads(result.samples[1].details)["exit_code"] != 0  # the rewritten checker was restored before it ran
    assert result.samples[0].metrics["executed_tool_calls"] == 2 and result.samples[0].metrics["submitted"] == 1
    assert result.samples[2].metrics["format_errors"] == 3 and result.samples[2].metrics["executed_tool_calls"] == 0


def test_a_bad_row_names_its_line(task_class, tmp_path):
    write_rows(tmp_path / "data", [{"id": "x", "question": "q", "files": {"a.py": ""}, "check": "missing.py"}])
    with pytest.raises(DataError, match=r"test.jsonl:1: field 'check'"):
        task_class(task_class.Options(sandbox="local")).load("test", data_dir=tmp_path / "data")
