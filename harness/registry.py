"""One registry mechanism for tasks, methods, backends, pipelines and executors (sandbox providers: ``sandbox``'s own
registry).

Every plug-in is declared as an entry point in the group ``opd_harness.<kind>``, the built-ins in this
project's pyproject.toml like any plug-in package's. An entry is either ``name = "module:object"`` (the
object is registered under ``name``) or ``name = "module"`` (importing the module registers ``name`` with
``Registry.add``; for a module that registers several names, each name gets its own entry).
``"prefix:*" = "module:factory"`` declares a prefix family: every name ``prefix:rest`` is built by
``factory(rest)`` (e.g. one task per lm-eval task). Entry points are loaded on the first lookup, so
importing ``harness`` stays cheap.

A plug-in is named once: its key (the entry point's name, or the one ``Registry.add(name, obj)`` call) is
its name, and the registry sets the object's ``name`` from it (``prefix:rest`` for a family's product). An
object that declares a different ``name`` of its own is refused.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # importlib.metadata (and tomllib) load with the first lookup: `harness --help` looks nothing up
    from importlib.metadata import EntryPoint

T = TypeVar("T")

PROJECT = "opd-harness"  # this project's distribution name
PREFIX_SUFFIX = ":*"  # an entry point named "prefix:*" declares a prefix family


class RegistryError(KeyError):
    """An unknown or duplicate registry name; the message lists what is valid."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name → plugin map with lazy built-ins, entry points and helpful errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entry_point_group = f"opd_harness.{kind}"
        self._items: dict[str, T] = {}
        self._prefixes: dict[str, Callable[[str], T]] = {}
        self._made: dict[str, T] = {}  # "prefix:rest" -> what its factory built (built once)
        self._loaded = False

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name``, which becomes its ``name``; re-registering the very same object is a no-op."""
        existing = self._items.get(name)
        if existing is not None and existing is not obj:
            raise RegistryError(f"duplicate {self.kind} name {name!r}: already registered by {_describe(existing)}")
        self._name(name, obj)
        self._items[name] = obj

    def _name(self, name: str, obj: object) -> None:
        """Set ``obj.name`` to its registry key (a class: the class attribute; a dataclass spec: its ``name`` field).
        A name the object declares itself must be that key: a plug-in is named once, by its entry point."""
        if not hasattr(obj, "__dict__"):  # e.g. a plain constant: nothing to name
            return
        declared = vars(obj).get("name")
        if declared not in (None, "", name):
            raise RegistryError(
                f"{self.kind} {name!r}: {_describe(obj)} declares name {declared!r}; a plug-in's name is its registry key "
                f"(its entry point's name), so drop the name it declares"
            )
        if isinstance(obj, type):
            setattr(obj, "name", name)
        else:  # object.__setattr__: also names a frozen dataclass (a MethodSpec) in place
            object.__setattr__(obj, "name", name)

    def add_prefix(self, prefix: str, factory: Callable[[str], T]) -> None:
        """Route every name ``prefix:REST`` to ``factory(REST)`` (e.g. ``lm_eval:gsm8k``); built once per name."""
        if not prefix or ":" in prefix:
            raise RegistryError(f"bad {self.kind} prefix {prefix!r}: must be non-empty and contain no ':'")
        existing = self._prefixes.get(prefix)
        if existing is not None and existing is not factory:
            raise RegistryError(f"duplicate {self.kind} prefix {prefix!r}: already registered by {_describe(existing)}")
        self._prefixes[prefix] = factory

    def prefix_description(self, prefix: str) -> tuple[str, str]:
        """What ``harness tasks`` shows for ``prefix:<name>``: the first paragraph of the family's factory docstring (what
        the family is) and its second (how to name a member; "" when the docstring has none)."""
        self._load()
        doc = inspect.cleandoc(self._prefixes[prefix].__doc__ or "")
        paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
        return (paragraphs[0] if paragraphs else ""), (paragraphs[1] if len(paragraphs) > 1 else "")

    def prefixes(self) -> list[str]:
        """Sorted registered prefixes (a name ``PREFIX:REST`` is built by that prefix's factory)."""
        self._load()
        return sorted(self._prefixes)

    def _load(self) -> None:
        """Load every declared entry point, once; a failure is retried next time."""
        if self._loaded:
            return
        self._loaded = True
        try:
            for ep in unique_entry_points(self.entry_point_group):
                self._add_entry_point(ep)
        except Exception:
            self._loaded = False
            raise

    def _add_entry_point(self, ep: EntryPoint) -> None:
        """Register what ``ep`` declares: an object, a prefix factory, or the names its module registers on import."""
        try:
            loaded = ep.load()
        except Exception as exc:
            raise RegistryError(f"{self.kind} entry point {_describe_entry_point(ep)} failed to load: {type(exc).__name__}: {exc}") from exc
        if ep.name.endswith(PREFIX_SUFFIX):
            self.add_prefix(ep.name[: -len(PREFIX_SUFFIX)], loaded)
        elif ep.attr is not None:
            self.add(ep.name, loaded)
        elif ep.name not in self._items:
            raise RegistryError(f"{self.kind} entry point {_describe_entry_point(ep)}: importing the module did not register {ep.name!r}")

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
            made = self._prefixes[prefix](rest)
            self._name(name, made)
            self._made[name] = made
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


def _describe_entry_point(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    origin = f" (from {dist.name} {dist.version})" if dist is not None else f" (from {PROJECT}'s pyproject.toml)"
    return f"{ep.name} = {ep.value}{origin}"


def installed_project_entry_points() -> list[EntryPoint]:
    """The entry points this project's installed distribution declares (none when it is not installed). Found by
    name (``importlib.metadata.distribution`` matches the metadata folder's name), so no distribution's metadata is
    parsed: reading a distribution's ``name`` parses its whole metadata file, this project's README included."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return list(distribution(PROJECT).entry_points)
    except PackageNotFoundError:
        return []


def source_tree_entry_points(group: str, pyproject: Path | None = None) -> list[EntryPoint] | None:
    """The entry points this project's pyproject.toml declares in ``group`` when the code runs from a
    source checkout (it sits beside ``harness/``); None for an installed wheel."""
    import tomllib
    from importlib.metadata import EntryPoint

    pyproject = pyproject or Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    if project.get("name") != PROJECT:
        return None
    declared = project.get("entry-points", {}).get(group, {})
    return [EntryPoint(name=name, value=value, group=group) for name, value in declared.items()]


def declared_entry_points(group: str) -> list[EntryPoint]:
    """Every entry point of ``group``: this project's (from its source checkout's pyproject.toml when there
    is one, so a stale or missing install cannot hide a built-in) and every other installed package's."""
    from importlib.metadata import entry_points

    installed = list(entry_points(group=group))
    source = source_tree_entry_points(group)
    if source is None:
        return installed
    ours = installed_project_entry_points()  # a stale install's declarations: the checkout's pyproject.toml wins
    return source + [ep for ep in installed if ep not in ours]


def unique_entry_points(group: str) -> list[EntryPoint]:
    """:func:`declared_entry_points` with identical declarations merged; one name declared twice with
    different values is a :class:`RegistryError` naming both."""
    chosen: dict[str, EntryPoint] = {}
    for ep in declared_entry_points(group):
        first = chosen.setdefault(ep.name, ep)
        if first.value != ep.value:
            raise RegistryError(
                f"duplicate {group} entry point {ep.name!r}: {_describe_entry_point(first)} and {_describe_entry_point(ep)}"
            )
    return list(chosen.values())


# The built-ins of each: [project.entry-points."opd_harness.<kind>"] in pyproject.toml.
TASKS: Registry = Registry("tasks")
METHODS: Registry = Registry("methods")
BACKENDS: Registry = Registry("backends")
PIPELINES: Registry = Registry("pipelines")
EXECUTORS: Registry = Registry("executors")
EVAL_EXECUTORS: Registry = Registry("eval_executors")
WEIGHT_SYNCS: Registry = Registry("weight_syncs")  # trainer.weight_sync: how learner weights reach the rollout workers
