import json
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from opd_harness.registry import (
    BACKENDS, EVAL_EXECUTORS, EXECUTORS, METHODS, PIPELINES, TASKS, Registry, RegistryError, source_tree_entry_points,
    unique_entry_points,
)


def test_duplicate_name_rejected():
    reg: Registry = Registry("things")
    reg.add("a", object())
    with pytest.raises(RegistryError, match="duplicate things name 'a'"):
        reg.add("a", object())


def test_same_object_twice_is_allowed():
    reg: Registry = Registry("things")
    obj = object()
    reg.add("a", obj)
    reg.add("a", obj)
    assert reg.get("a") is obj


def test_the_registry_key_is_the_name():
    reg: Registry = Registry("things")

    class Widget:
        pass

    reg.add("widget", Widget)
    assert reg.get("widget") is Widget and Widget.name == "widget"
    assert reg.names() == ["widget"]


def test_a_differing_declared_name_is_refused():
    reg: Registry = Registry("things")

    class Gadget:
        name = "gadget"

    with pytest.raises(RegistryError, match=r"things 'widget': .*Gadget declares name 'gadget'; a plug-in's name is its registry key"):
        reg.add("widget", Gadget)
    reg.add("gadget", Gadget)  # the same name twice is no second name
    assert reg.names() == ["gadget"]


def test_a_method_spec_gets_its_name_from_its_key():
    from opd_harness.method import HParams, MethodSpec

    spec = MethodSpec(description="d", objective=lambda *a: None, hparams=HParams, needs=lambda hp: frozenset())
    reg: Registry = Registry("things")
    reg.add("m", spec)
    assert reg.get("m") is spec and spec.name == "m" and spec.describe()["name"] == "m"


def test_a_family_product_is_named_prefix_colon_rest():
    reg: Registry = Registry("things")
    reg.add_prefix("fam", lambda rest: type(f"Made[{rest}]", (), {}))
    assert reg.get("fam:x").name == "fam:x"
    assert TASKS.get("retool:aime24").name == "retool:aime24" and TASKS.get("lm_eval:anything").name == "lm_eval:anything"


def test_every_builtin_is_named_by_its_key():
    for registry in (TASKS, METHODS, BACKENDS, PIPELINES, EXECUTORS, EVAL_EXECUTORS):
        for name, obj in registry.items():
            assert obj.name == name, (registry.kind, name)


def test_unknown_name_lists_valid_names_and_closest_match():
    with pytest.raises(RegistryError) as info:
        METHODS.get("opdd")
    message = str(info.value)
    assert "Did you mean 'opd'?" in message
    assert "opd" in message and "sft" in message


def test_builtins_are_registered():
    assert {"arith", "math500", "aime24", "aime25", "amc23", "olympiadbench", "minerva", "gsm8k", "dapo_math"} <= set(TASKS.names())
    assert {"opd", "sft"} <= set(METHODS.names())
    assert set(PIPELINES.names()) == {"sync", "async"} and set(EXECUTORS.names()) == {"inprocess", "ray"}
    assert set(EVAL_EXECUTORS.names()) == {"ray"}  # harness eval's in-process shards need no plug-in
    assert {"hf", "replay", "openai", "vllm"} <= set(BACKENDS.names())


def test_third_party_plugin_through_entry_point(tmp_path, monkeypatch):
    (tmp_path / "fake_plugin_mod.py").write_text(
        textwrap.dedent(
            """
            class MyTask:
                name = "my_task"
            """
        )
    )
    dist = tmp_path / "fake_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[opd_harness.tasks]\nmy_task = fake_plugin_mod:MyTask\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry = Registry("tasks")
    assert reg.get("my_task").name == "my_task"
    sys.modules.pop("fake_plugin_mod", None)


# ---------------------------------------------------------------------------------------------
# Entry points: the built-ins are declared in pyproject.toml like any plug-in


def _declared(group: str) -> dict[str, str]:
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    return pyproject["project"]["entry-points"][group]


@pytest.mark.parametrize(
    "registry", [TASKS, METHODS, BACKENDS, PIPELINES, EXECUTORS], ids=["tasks", "methods", "backends", "pipelines", "executors"]
)
def test_every_builtin_name_is_declared_as_an_entry_point(registry):
    declared = _declared(registry.entry_point_group)
    names = {name for name in declared if not name.endswith(":*")}
    prefixes = {name[:-2] for name in declared if name.endswith(":*")}
    public = {name for name in registry.names() if not name.startswith("_")}  # "_x": registered by other tests
    assert names and public == names  # nothing registered on import goes undeclared
    assert set(registry.prefixes()) == prefixes


def test_sandbox_entry_points_name_the_builtin_providers():
    from opd_harness import sandbox

    assert set(sandbox.declared_providers()) == {"docker", "local"}
    assert sandbox.provider("local") is sandbox.declared_providers()["local"].load()
    assert sandbox.provider("local").name == "local"  # the name comes from the entry-point key


def test_sandbox_provider_declared_by_an_entry_point_is_found(monkeypatch):
    """A provider another package declares in ``opd_harness.sandboxes`` is listed, loaded and opened by its key."""
    import importlib.metadata

    from opd_harness import sandbox
    from opd_harness.sandbox.local import LocalSandbox

    fake = type("FakeProvider", (LocalSandbox,), {"__module__": __name__})
    monkeypatch.setitem(globals(), "FakeProvider", fake)
    ep = importlib.metadata.EntryPoint(name="_fake_ep", value=f"{__name__}:FakeProvider", group=sandbox.ENTRY_POINT_GROUP)
    real = sandbox.entry_points
    with_fake = lambda group: [*real(group=group), ep] if group == sandbox.ENTRY_POINT_GROUP else real(group=group)  # noqa: E731
    monkeypatch.setattr(sandbox, "entry_points", with_fake)
    monkeypatch.setattr(sandbox, "_providers", dict(sandbox._providers))  # what this test loads is forgotten after it
    assert "_fake_ep" in sandbox.provider_names()
    with sandbox.open_sandbox("_fake_ep") as sb:
        assert type(sb) is fake and fake.name == "_fake_ep"
    with pytest.raises(KeyError, match="valid: .*_fake_ep"):
        sandbox.open_sandbox("_fake_epx")


def _plugin_dist(root: Path, name: str, entry_points: str, module: str | None = None, code: str = "") -> None:
    """A fake installed distribution under ``root``: ``name-0.1.dist-info`` with METADATA and entry_points.txt."""
    dist = root / f"{name}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    if module:
        (root / f"{module}.py").write_text(textwrap.dedent(code))


def test_plugin_claiming_a_builtin_name_is_refused(tmp_path, monkeypatch):
    entries = "[opd_harness.tasks]\narith = greedy_plugin_mod:Other\n"
    _plugin_dist(tmp_path, "greedy-plugin", entries, "greedy_plugin_mod", "class Other:\n    name = 'arith'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError, match=r"duplicate opd_harness.tasks entry point 'arith'.*greedy-plugin"):
        Registry("tasks").names()
    sys.modules.pop("greedy_plugin_mod", None)


def test_identical_declarations_are_merged(tmp_path, monkeypatch):
    # e.g. a stale install of this project declaring the same sandboxes as the checkout
    for dist in ("twin-a", "twin-b"):
        sub = tmp_path / dist
        sub.mkdir()
        _plugin_dist(sub, dist, "[opd_harness.things]\nwidget = twin_mod:Widget\n")
        monkeypatch.syspath_prepend(str(sub))
    (tmp_path / "twin_mod.py").write_text("class Widget:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry = Registry("things")
    assert reg.names() == ["widget"] and reg.get("widget").__name__ == "Widget"
    sys.modules.pop("twin_mod", None)


def test_a_stale_install_of_this_project_yields_to_the_checkout(tmp_path, monkeypatch):
    """An installed opd-harness ahead on sys.path declaring an old ``arith``: the checkout's pyproject.toml declares
    the built-ins, the install's declarations are dropped (not a duplicate), another package's plug-in stays."""
    _plugin_dist(tmp_path, "opd_harness", "[opd_harness.tasks]\narith = stale_mod:OldArith\n")
    _plugin_dist(tmp_path, "other-plugin", "[opd_harness.tasks]\nother = other_mod:Other\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    declared = {ep.name: ep.value for ep in unique_entry_points("opd_harness.tasks")}
    assert declared["arith"] == _declared("opd_harness.tasks")["arith"] and declared["other"] == "other_mod:Other"


def test_module_entry_points_and_prefix_families(tmp_path, monkeypatch):
    code = """
        from opd_harness.registry import Registry
        REG = Registry("gadgets")  # a registry of its own, so the test touches no real one

        def make(rest):
            return ("made", rest)

        REG.add("one", 1)  # a module that registers several names on import: one entry point per name
        REG.add("two", 2)
        """
    entries = "[opd_harness.gadgets]\none = gadget_mod\ntwo = gadget_mod\nfam:* = gadget_mod:make\n"
    _plugin_dist(tmp_path, "gadget-plugin", entries, "gadget_mod", code)
    monkeypatch.syspath_prepend(str(tmp_path))
    import gadget_mod

    assert gadget_mod.REG.get("fam:x") == ("made", "x")  # the prefix entry point built it
    assert gadget_mod.REG.names() == ["one", "two"] and gadget_mod.REG.prefixes() == ["fam"]
    sys.modules.pop("gadget_mod", None)


def test_module_entry_point_that_registers_nothing_is_an_error(tmp_path, monkeypatch):
    _plugin_dist(tmp_path, "lazy-plugin", "[opd_harness.tasks_x]\nghost = lazy_plugin_mod\n", "lazy_plugin_mod", "X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        RegistryError, match=r"ghost = lazy_plugin_mod \(from lazy-plugin 0.1\): importing the module did not register 'ghost'"
    ):
        Registry("tasks_x").names()
    sys.modules.pop("lazy_plugin_mod", None)


def test_broken_plugin_names_its_entry_point_and_is_retried(tmp_path, monkeypatch):
    entries = "[opd_harness.tasks_y]\nbad = broken_plugin_mod:Task\n"
    _plugin_dist(tmp_path, "broken-plugin", entries, "broken_plugin_mod", "import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry = Registry("tasks_y")
    for _ in range(2):  # a failed load is not remembered as done
        with pytest.raises(
            RegistryError, match=r"bad = broken_plugin_mod:Task \(from broken-plugin 0.1\) failed to load: ModuleNotFoundError"
        ):
            reg.get("bad")


def test_source_tree_entry_points_read_pyproject(tmp_path):
    declared = '[project.entry-points."opd_harness.tasks"]\narith = "m:A"\n"fam:*" = "m:f"\n'
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "opd-harness"\n' + declared)
    eps = source_tree_entry_points("opd_harness.tasks", tmp_path / "pyproject.toml")
    assert [(ep.name, ep.value) for ep in eps] == [("arith", "m:A"), ("fam:*", "m:f")]
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert source_tree_entry_points("opd_harness.tasks", tmp_path / "pyproject.toml") is None
    assert source_tree_entry_points("opd_harness.tasks", tmp_path / "missing.toml") is None


def test_installed_metadata_alone_serves_every_builtin():
    """What an installed wheel sees (no pyproject.toml beside harness/): the distribution's own entry points."""
    kinds = ("tasks", "methods", "backends", "pipelines", "executors", "eval_executors", "sandboxes")
    groups = {kind: f"opd_harness.{kind}" for kind in kinds}
    installed = {
        kind: {ep.name: ep.value for ep in entry_points(group=group) if ep.dist is not None and ep.dist.name == "opd-harness"}
        for kind, group in groups.items()
    }
    if not installed["tasks"]:
        pytest.skip("the installed opd-harness predates its task/method entry points: run `pip install --no-deps -e .`")
    assert installed == {kind: _declared(group) for kind, group in groups.items()}
    code = (  # a fresh interpreter, so that the modules register on import into the real registries
        "import json, opd_harness.registry as r, opd_harness.sandbox as s\n"
        "r.source_tree_entry_points = lambda group, pyproject=None: None\n"
        "s._source_tree_entry_points = lambda: None\n"
        "print(json.dumps({k: sorted(g.names() + [p + ':*' for p in g.prefixes()]) for k, g in "
        f"((k, getattr(r, k.upper())) for k in {kinds[:-1]!r})}} | {{'sandboxes': s.provider_names()}}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert json.loads(result.stdout) == {kind: sorted(names) for kind, names in installed.items()}


def test_harness_tasks_lists_the_task_families():
    from typer.testing import CliRunner

    from opd_harness.cli import app

    out = " ".join(CliRunner().invoke(app, ["tasks"]).output.split())
    assert "retool:<name> a family of tasks: Any math task solved with a Python code interpreter" in out
    assert "lm_eval:<name> a family of tasks: Any lm-evaluation-harness task" in out
    assert "Name one retool:<task> with a math task graded by math-verify, e.g. retool:aime24" in out  # how to name one
    assert "Name one lm_eval:<task> with an lm-eval task name, e.g. lm_eval:gsm8k (lm-eval ls tasks lists them)" in out
