"""The project's documents stand on their own and match the code: no path outside the repository, every relative link
resolves, every page of the site is in its navigation, README stays one screen with the set-up commands CI runs, the
generated references cover every command, config key and method, and the documented examples run."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("**/*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) with a relative target
UP = re.compile(r"(?:\.\./)+[\w.\-/]*")  # a relative path that climbs: ../x, ../../y/z
README_COMMANDS = (  # .ci/run runs the second verbatim, the tests' set-up is the first
    "python3 -m venv .venv && .venv/bin/pip install -q -c requirements/ci.lock torch==2.13.0 -e . "
    "&& .venv/bin/harness run --preset cpu-demo",
    "python3 -m venv .venv && .venv/bin/pip install -q -c requirements/ci.lock torch==2.13.0 -e '.[dev]' && .venv/bin/python -m pytest -q",
)

sys.path.insert(0, str(ROOT / "docs"))
import gen_reference  # noqa: E402


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return [p for item in node for p in _nav_pages(item)]


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def _block(page: str, section: str, lang: str = "python") -> str:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(rf"```{lang}\n(.*?)```", text, re.DOTALL).group(1)


def _module(name: str, source: str, tmp_path: Path):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_documents_name_nothing_outside_the_repository() -> None:
    """A climbing path (a link between pages, ../layouts/x.yaml) is fine while it stays inside the repository."""
    outside = []
    for doc in DOCS:
        for path in UP.findall(doc.read_text(encoding="utf-8")):
            if not (doc.parent / path).resolve().is_relative_to(ROOT):
                outside.append(f"{doc.relative_to(ROOT)}: {path}")
    assert outside == []


def test_every_relative_link_resolves_inside_the_repository() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or not path.is_relative_to(ROOT):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


PRODUCT = [
    path
    for folder in ("harness", "trainers", "tasks", "sandbox", "recipes")
    for path in sorted((ROOT / folder).glob("**/*"))
    if path.suffix in {".py", ".yaml"}
]
SECTION_SIGN = re.compile(r"(.{0,20})§")
A_PAPERS_SECTION = re.compile(r"(paper|report|report's|\(arXiv [\d.]+\),) $")
PAGE_SECTION = re.compile(r"(?:docs/methods/|\b)([a-z][\w-]*)(?:\.md,| page,?) '([^']+)'")


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def test_section_signs_name_a_papers_section() -> None:
    """'§' cites a paper's own section ('paper §5.2', 'report's §4.6'); the method specification the code was written
    from is not part of the repository, so its section numbers mean nothing to a reader."""
    bare = []
    for path in [*DOCS, *PRODUCT]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for before in SECTION_SIGN.findall(line):
                if not A_PAPERS_SECTION.search(before):
                    bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert bare == []


def test_method_page_sections_the_code_cites_exist() -> None:
    """"docs/methods/f-opd.md, 'Adaptive refresh'" (or "f-opd page, 'Adaptive refresh'") names a heading of that page."""
    missing, cited = [], 0
    for path in PRODUCT:
        text = path.read_text(encoding="utf-8")
        for page, section in PAGE_SECTION.findall(text):
            doc = ROOT / "docs" / "methods" / f"{page}.md"
            if not doc.exists():
                continue
            cited += 1
            if section not in _headings(doc):
                missing.append(f"{path.relative_to(ROOT)}: {page}.md '{section}'")
    assert cited > 10
    assert missing == []


def test_every_page_of_the_site_is_in_its_navigation_and_every_nav_entry_exists() -> None:
    config = _mkdocs()
    assert config["strict"] is True and config["theme"]["name"] == "material"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav))
    assert [p for p in nav if not (ROOT / "docs" / p).is_file()] == []
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").glob("**/*.md")}
    assert pages - set(nav) == set()


def test_readme_is_one_screen_with_the_commands_ci_runs_and_no_dated_history() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for command in README_COMMANDS:
        assert command in readme
    assert README_COMMANDS[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", readme) == []  # measurements and history live on the site's Results pages
    assert re.findall(r"(?i)\bissue \d+|#\d+\b", readme) == []
    assert "--student Qwen/Qwen3-1.7B --teacher Qwen/Qwen3-8B" in readme  # the headline command, real model ids
    assert "not run" in readme  # the support matrix says what has not run


def test_readme_links_the_architecture_document_which_covers_every_folder() -> None:
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    folders = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert sorted(folders) == ["harness", "recipes", "sandbox", "tasks", "trainers"]
    assert all(f"`{name}/`" in architecture for name in folders)
    for section in ("## The seams", "## Flow of `harness run`", "## Flow of `harness eval`", "## Results store", "## The episode contract"):
        assert section in architecture


def test_the_cli_reference_is_generated_and_lists_every_command_and_option() -> None:
    """The page holds the marker the build hook fills; what it is filled with covers every command and flag of the app,
    so a command or flag added to the CLI appears in the reference without anyone editing a page."""
    assert "<!-- gen:cli -->" in (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    commands = gen_reference.cli_commands()
    assert {"harness run", "harness eval", "harness serve", "harness gate", "harness data fetch", "harness sandbox build"} <= set(commands)
    text = gen_reference.cli_markdown()
    missing = [name for name in commands if f"\n## {name}\n" not in text]
    missing += [f"{name} {opt}" for name, cmd in commands.items() for p in cmd.params if not p.hidden for opt in p.opts
                if p.param_type_name == "option" and f"`{opt}`" not in text]
    assert missing == []


def test_the_config_reference_is_generated_and_lists_every_key() -> None:
    from opd_harness.config import RunConfig, TrainerConfig

    assert "<!-- gen:config -->" in (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    text = gen_reference.config_markdown()
    keys = [key for key, _ in gen_reference.config_fields()]
    assert [k for k in keys if f"| `{k}` |" not in text] == []
    assert {f"trainer.{name}" for name in TrainerConfig.model_fields} <= set(keys)  # every field, weight_sync or lr alike
    assert set(RunConfig.model_fields) <= set(keys)
    assert {"trainer.layout.learner.sharding", "teacher.signal", "eval.tasks"} <= set(keys)


def test_every_method_has_a_page_that_generates_its_keys() -> None:
    pages = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "methods").glob("*.md"))
    markers = set(re.findall(r"<!-- gen:method ([\w-]+) -->", pages))
    assert markers == set(gen_reference.method_names())
    for name in markers:
        text = gen_reference.method_markdown(name)
        from opd_harness.registry import METHODS

        assert all(f"| `{key}` |" in text for key in METHODS.get(name).hparams.model_fields)


def test_the_documented_single_turn_task_loads_and_grades(tmp_path) -> None:
    module = _module("my_math_doc", _block("extending/add-a-task.md", "A single-turn task graded by math-verify"), tmp_path)
    data = tmp_path / "data" / "my_math"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text('{"id": 1, "question": "1+1?", "answer": "2"}\n{"id": 2, "question": "2+2?", "answer": "4"}\n')
    task = module.MyMathTask()
    problems = task.load("test", tmp_path / "data")
    assert [p.id for p in problems] == ["1", "2"] and task.options.k == 4
    scores = task.grade_many(problems, ["so \\boxed{2}", "\\boxed{5}"])
    assert [s.status for s in scores] == ["pass", "fail"]


def test_the_documented_method_runs_and_registers(tmp_path) -> None:
    import torch

    from opd_harness.method import StudentOutputs
    from opd_harness.registry import METHODS
    from opd_harness.trajectory import TensorBatch

    module = _module("my_opd_doc", _block("extending/add-a-method.md", "A complete example"), tmp_path)
    spec, hp = module.MY_OPD_SPEC, module.MyOPDParams(coef=2.0)
    assert spec.needs(hp) == {"behaviour_logprobs", "teacher_logprobs"}
    B, T = 2, 5
    q = torch.log(torch.rand(B, T) * 0.9 + 0.05)
    batch = TensorBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long), attention_mask=torch.ones(B, T, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float), step_index=torch.zeros(B, T, dtype=torch.long),
        behaviour_logprobs=q, teacher_logprobs=q - 0.3, rewards=torch.full((B,), float("nan")),
        policy_version=torch.zeros(B, dtype=torch.long), group_ids=torch.arange(B),
    )
    s = q.clone().requires_grad_(True)
    loss, diagnostics = spec.objective(batch, StudentOutputs(logprobs=s), hp, None)
    loss.backward()
    assert torch.isfinite(loss) and diagnostics["teacher_kl"] == pytest.approx(0.3, abs=1e-5)
    # at ρ = 1 the gradient is -A_t / #tokens on the masked tokens: A_t = -2·0.3
    assert torch.allclose(s.grad, batch.loss_mask * 0.6 / batch.loss_mask.sum(), atol=1e-6)
    name = "_doc_my_opd"
    METHODS.add(name, spec)
    try:
        assert METHODS.get(name).describe()["name"] == name
    finally:
        METHODS._items.pop(name, None)


def test_the_documented_method_test_passes(tmp_path, monkeypatch) -> None:
    """The add-a-method page's test, run against the page's example installed as ``my_package.my_opd``."""
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_opd.py").write_text(_block("extending/add-a-method.md", "A complete example"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _module("test_my_opd_doc", _block("extending/add-a-method.md", "Its test"), tmp_path)
    tests = [getattr(module, name) for name in dir(module) if name.startswith("test_")]
    assert len(tests) == 1
    tests[0]()
    monkeypatch.delitem(sys.modules, "my_package.my_opd")
    monkeypatch.delitem(sys.modules, "my_package")


# (method, hyper-parameters) beyond the defaults that log more diagnostics
METRIC_VARIANTS = {"opd": ({}, {"estimator": "full"}), "ap_opd": ({}, {"clip": True}), "iw_opd": ({}, {"clip": True})}


def test_every_method_page_names_the_metrics_its_objective_logs(tiny_model_factory) -> None:
    """Every diagnostic an objective returns is stored as a step metric under its own name; its method page (the one that
    generates the method's keys) names each of them, so a metric added to an objective and not documented fails here."""
    import dataclasses

    import torch
    from test_chunked_vocab import batch_for

    from opd_harness.registry import METHODS
    from opd_harness.trainers.learner import student_pass

    pages = {name: page for page in (ROOT / "docs" / "methods").glob("*.md")
             for name in re.findall(r"<!-- gen:method ([\w-]+) -->", page.read_text(encoding="utf-8"))}  # fmt: skip
    model = tiny_model_factory(seed=3, hidden=32, layers=1)
    graded = {"rewards": torch.tensor([1.0, 0.0, 1.0]), "group_ids": torch.zeros(3, dtype=torch.long)}  # one group of three
    batch = dataclasses.replace(batch_for(model.config.vocab_size), **graded)
    missing, seen = [], 0
    for name in gen_reference.method_names():
        spec, text = METHODS.get(name), pages[name].read_text(encoding="utf-8")
        for args in METRIC_VARIANTS.get(name, ({},)):
            hp = spec.hparams(**args)
            student = student_pass(model, batch, full="student_full" in spec.needs(hp))
            _, diagnostics = spec.objective(batch, student.outputs, hp, spec.make_state(hp) if spec.make_state else None)
            seen += len(diagnostics)
            missing += [f"{pages[name].name}: {name} {args} logs `{key}`" for key in diagnostics if f"`{key}`" not in text]
    assert seen > 100
    assert sorted(set(missing)) == []


IMPORT = re.compile(r"^\s*from (opd_harness[\w.]*) import ([\w, ]+)$", re.MULTILINE)


def test_the_python_api_reference_is_generated_and_every_name_imports_with_its_own_docstring() -> None:
    """Each listed name imports; classes and functions carry a docstring of their own (not one inherited from a base
    class), and the generated page has an entry for every name."""
    import inspect

    assert "<!-- gen:api -->" in (ROOT / "docs" / "reference" / "python-api.md").read_text(encoding="utf-8")
    undocumented = []
    for name in gen_reference.api_names():
        obj = gen_reference.api_object(name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            undocumented.append(name)
    assert undocumented == []
    text = gen_reference.api_markdown()
    assert [n for n in gen_reference.api_names() if f"\n### `{n}`\n" not in "\n" + text] == []


def test_every_name_the_guides_import_from_the_harness_is_in_the_python_api() -> None:
    """What the extending guides' and the API page's examples import is what the API page documents."""
    pages = [*(ROOT / "docs" / "extending").glob("*.md"), ROOT / "docs" / "reference" / "python-api.md"]
    imported = {f"{module}.{name.strip()}" for page in pages for module, names in IMPORT.findall(page.read_text(encoding="utf-8"))
                for name in names.split(",") if name.strip()}
    assert len(imported) >= 10  # the task, method and store examples
    assert sorted(imported - set(gen_reference.api_names())) == []


def test_the_documented_results_store_reader_runs(tmp_path) -> None:
    """The API page's example reads a store written through `Store`: Avg@k rows, per-problem means without error
    samples, and the paired comparison's delta."""
    from opd_harness.store import SampleRow, Store

    module = _module("store_reader_doc", _block("reference/python-api.md", "Reading a results store"), tmp_path)

    def samples(passed: set[str], errored: set[str] = frozenset()) -> list[SampleRow]:
        def row(pid: str, i: int) -> SampleRow:  # an error sample scores 0: the reader must leave it out, not average it in
            if (pid, i) in errored:
                return SampleRow(pid, i, "", None, 0.0, "error", 0.1)
            return SampleRow(pid, i, "", None, float(pid in passed), "pass" if pid in passed else "fail", 0.1)

        return [row(pid, i) for pid in ("p1", "p2", "p3", "p4") for i in range(2)]

    root = tmp_path / "out"
    with Store(root) as store:
        for run, passed, errored in (("a", {"p1"}, set()), ("b", {"p1", "p2", "p3"}, {("p3", 0)})):
            store.create_run(run, kind="eval", config={})
            summary = {"k": 2, "n_samples": 8, "n_problems": 4, "avg_at_k": len(passed) / 4, "ci_low": 0.0, "ci_high": 1.0}
            store.add_eval(run, 0, "math500", summary, samples(passed, errored), grader="g", grader_version="1")
    assert module.evaluations(str(root)) == [("a", 0, "math500", 0.25, 0.0, 1.0), ("b", 0, "math500", 0.75, 0.0, 1.0)]
    assert module.per_problem(str(root), "b", 0, "math500") == {"p1": 1.0, "p2": 1.0, "p3": 1.0, "p4": 0.0}
    result = module.compare(str(root), ("a", 0), ("b", 0), "math500")
    assert (result.n, result.mean_a, result.mean_b, result.delta) == (4, 0.25, 0.75, 0.5)
