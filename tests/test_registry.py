import sys
import textwrap

import pytest

from harness.registry import METHODS, PIPELINES, TASKS, Registry, RegistryError


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


def test_decorator_registers():
    reg: Registry = Registry("things")

    @reg.register("widget")
    class Widget:
        pass

    assert reg.get("widget") is Widget
    assert reg.names() == ["widget"]


def test_unknown_name_lists_valid_names_and_closest_match():
    with pytest.raises(RegistryError) as info:
        METHODS.get("opdd")
    message = str(info.value)
    assert "Did you mean 'opd'?" in message
    assert "opd" in message and "sft" in message


def test_builtins_are_registered():
    assert {"arith", "math500", "aime24", "aime25", "amc23", "olympiadbench", "minerva", "gsm8k", "dapo_math"} <= set(TASKS.names())
    assert {"opd", "sft"} <= set(METHODS.names())
    assert "sync" in PIPELINES.names()


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
