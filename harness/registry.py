"""One registry mechanism for tasks, methods, backends, sandboxes and pipelines.

Plugins register under a string name with a decorator; third-party packages add entries through
the entry-point group ``opd_harness.<kind>``. A prefix factory (``add_prefix``) serves a whole family of
names ``prefix:rest`` that cannot be listed up front (e.g. one task per external benchmark suite entry). Built-in modules are imported lazily on first lookup,
so importing ``harness`` stays cheap.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate registry name; the message lists what is valid."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name → plugin map with lazy built-ins, entry points and helpful errors."""

    def __init__(self, kind: str, builtin_modules: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.entry_point_group = f"opd_harness.{kind}"
        self._builtin_modules = builtin_modules
        self._items: dict[str, T] = {}
        self._prefixes: dict[str, Callable[[str], T]] = {}
        self._made: dict[str, T] = {}  # "prefix:rest" -> what its factory built (built once)
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name``; a second registration is refused."""

        def decorate(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorate

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name``; re-registering the very same object is a no-op."""
        existing = self._items.get(name)
        if existing is not None and existing is not obj:
            raise RegistryError(f"duplicate {self.kind} name {name!r}: already registered by {_describe(existing)}")
        self._items[name] = obj

    def add_prefix(self, prefix: str, factory: Callable[[str], T]) -> None:
        """Route every name ``prefix:REST`` to ``factory(REST)`` (e.g. ``lm_eval:gsm8k``); built once per name."""
        if not prefix or ":" in prefix:
            raise RegistryError(f"bad {self.kind} prefix {prefix!r}: must be non-empty and contain no ':'")
        existing = self._prefixes.get(prefix)
        if existing is not None and existing is not factory:
            raise RegistryError(f"duplicate {self.kind} prefix {prefix!r}: already registered by {_describe(existing)}")
        self._prefixes[prefix] = factory

    def prefixes(self) -> list[str]:
        """Sorted registered prefixes (a name ``PREFIX:REST`` is built by that prefix's factory)."""
        self._load()
        return sorted(self._prefixes)

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._builtin_modules:
            importlib.import_module(module)
        for ep in entry_points(group=self.entry_point_group):
            if ep.name in self._items:
                continue
            loaded = ep.load()
            if ep.name not in self._items:  # the module may have registered itself on import
                self.add(ep.name, loaded)

    def get(self, name: str) -> T:
        """The plugin called ``name``; an unknown name lists the valid ones and the closest match."""
        self._load()
        if name in self._items:
            return self._items[name]
        prefix, sep, rest = name.partition(":")
        if sep and prefix in self._prefixes:
            return self._from_prefix(name, prefix, rest)
        valid = sorted(self._items)
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        patterns = "".join(f", {p}:<name>" for p in sorted(self._prefixes))
        raise RegistryError(f"unknown {self.kind} {name!r}.{hint} Valid {self.kind}: {', '.join(valid) or '(none)'}{patterns}")

    def _from_prefix(self, name: str, prefix: str, rest: str) -> T:
        """The object ``factory(rest)`` for ``prefix:rest``, built on first use and then reused."""
        if not rest.strip():
            raise RegistryError(f"{self.kind} name {name!r}: expected {prefix}:<name> with a name after the colon")
        if name not in self._made:
            self._made[name] = self._prefixes[prefix](rest)
        return self._made[name]

    def names(self) -> list[str]:
        """Sorted registered names."""
        self._load()
        return sorted(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        """(name, plugin) pairs, sorted by name."""
        for name in self.names():
            yield name, self._items[name]

    def __contains__(self, name: object) -> bool:
        """Registered names, and any ``prefix:rest`` with a registered prefix (its factory may still refuse it)."""
        self._load()
        if name in self._items:
            return True
        prefix, sep, rest = name.partition(":") if isinstance(name, str) else ("", "", "")
        return bool(sep and rest.strip() and prefix in self._prefixes)


def _describe(obj: object) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, 'name', type(obj).__name__))}"


TASKS: Registry = Registry(
    "tasks", ("tasks.synthetic.arith", "tasks.math.benchmarks", "tasks.code.evalplus", "tasks.code.livecodebench", "tasks.lm_eval_bridge")
)
METHODS: Registry = Registry(
    "methods",
    tuple(
        f"trainers.objectives.{m}"
        for m in ("opd", "sft", "grpo", "sod", "saf", "ap_opd", "iw_opd", "eopd", "gkd", "f_opd")
    ),
)
BACKENDS: Registry = Registry("backends", ("harness.backends.hf", "harness.backends.replay", "harness.backends.openai_backend", "harness.backends.vllm_backend"))
SANDBOXES: Registry = Registry("sandboxes")
PIPELINES: Registry = Registry("pipelines", ("trainers.loop",))
EXECUTORS: Registry = Registry("executors", ("trainers.inprocess", "trainers.ray_executor"))
