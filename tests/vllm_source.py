"""vLLM's source read with ``ast``, never imported: names resolved as Python would resolve them at run time.

``tests/test_vllm_api.py`` uses this in source mode (``HARNESS_VLLM_SOURCE``: a folder holding the ``vllm`` package's
``.py`` files, extracted from the wheel by ``.ci/legs/vllm_source.sh``), where installing vLLM's ~9 GB of CUDA wheels
would cost CI too much. What it follows:

* module-level bindings (``class``, ``def``, assignments, ``from x import y [as z]``, ``import x``), in order, inside
  ``if``/``try`` blocks too; an ``if TYPE_CHECKING:`` body is skipped (it does not run) and an ``except`` handler is a
  fallback, read only when nothing else binds the name;
* a module ``__getattr__`` fed by a dict of ``"name": "module:attribute"`` strings (``vllm/__init__.py``'s lazy
  ``MODULE_ATTRS``);
* submodules of a package, relative imports, class bases (a name re-exported elsewhere is followed to its definition);
* class members through the bases, depth-first (a base outside vLLM, e.g. ``msgspec.Struct``, is recorded, not read);
* signatures from ``def`` statements (the last one in a class body wins, as at run time: ``@overload`` stubs come
  first), and the generated ``__init__`` of field classes (dataclasses, vLLM's ``@config``, ``msgspec.Struct``,
  pydantic ``BaseModel``, ``TypedDict``): their annotated fields, taken as keyword arguments.

A name that cannot be resolved raises :class:`NotFound` with the chain it followed, so a rename upstream fails with the
name, the module and the file where it was looked for.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

FIELD_DECORATORS = {"dataclass", "config"}  # vllm.config.utils.config makes a pydantic dataclass
FIELD_BASES = {"Struct", "BaseModel", "TypedDict"}  # msgspec, pydantic, typing: annotated fields are the constructor


class NotFound(LookupError):
    """A vLLM name, member or field the source does not define."""


@dataclass(frozen=True)
class Found:
    """A definition in vLLM's source: ``node`` is a ``ClassDef``, ``FunctionDef``, assignment or ``Module``."""

    module: str
    name: str
    node: ast.AST
    path: Path
    root: Path

    @property
    def where(self) -> str:
        """``vllm/x/y.py:LINE``, relative to the source root."""
        return f"{self.path.relative_to(self.root).as_posix()}:{getattr(self.node, 'lineno', 1)}"


@dataclass(frozen=True)
class External:
    """A name bound outside vLLM (``msgspec.Struct``, ``ValueError``): recorded, never read."""

    qualname: str


class _Default:
    """A parameter default shown as its source text in a signature."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _default(node: ast.expr | None):
    return inspect.Parameter.empty if node is None else _Default(ast.unparse(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt], fallbacks: bool) -> list[ast.stmt]:
    """The module-level statements that run, in order; ``except`` handlers only when ``fallbacks``."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                out += _statements(stmt.body, fallbacks)
            out += _statements(stmt.orelse, fallbacks)
        elif isinstance(stmt, ast.Try):
            out += _statements(stmt.body + stmt.orelse + stmt.finalbody, fallbacks)
            if fallbacks:
                out += [s for h in stmt.handlers for s in _statements(h.body, fallbacks)]
        else:
            out.append(stmt)
    return out


def _targets(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [stmt.name]
    return []


def _last_name(node: ast.expr) -> str:
    """``x`` of ``x``, ``a.x``, ``x(...)``, ``x[...]``."""
    while isinstance(node, (ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _is_classvar(annotation: ast.expr) -> bool:
    return _last_name(annotation) == "ClassVar"


def _field_in_init(stmt: ast.AnnAssign) -> bool:
    """False for ``x: T = field(init=False)``."""
    value = stmt.value
    if isinstance(value, ast.Call) and _last_name(value.func) == "field":
        return not any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords)
    return True


class VLLMSource:
    """The ``vllm`` package under ``root`` (``root/vllm/__init__.py``), read and resolved without importing it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise NotFound(f"{self.root}: no vllm/__init__.py (the folder must hold the vllm package's source)")
        self._trees: dict[str, tuple[ast.Module, Path, str]] = {}

    # ------------------------------------------------------------------ modules

    def _file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def is_module(self, module: str) -> bool:
        return self._file(module) is not None

    def module(self, module: str) -> tuple[ast.Module, Path, str]:
        """The parsed module, its file and its text."""
        if module not in self._trees:
            path = self._file(module)
            if path is None:
                looked = f"{module.replace('.', '/')}.py or its __init__.py under {self.root}"
                raise NotFound(f"vLLM has no module {module} (looked for {looked})")
            text = path.read_text()
            self._trees[module] = (ast.parse(text, str(path)), path, text)
        return self._trees[module]

    def _package(self, module: str) -> str:
        return module if self.module(module)[1].name == "__init__.py" else module.rpartition(".")[0]

    def _absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        return importlib.util.resolve_name("." * stmt.level + (stmt.module or ""), self._package(module))

    # ------------------------------------------------------------------ names

    def resolve(self, module: str, name: str, _seen: frozenset = frozenset()) -> Found | External:
        """What ``from module import name`` gives at run time, followed to its definition."""
        if not module.startswith("vllm"):
            return External(f"{module}.{name}")
        if (module, name) in _seen:
            raise NotFound(f"{module}.{name}: circular re-export")
        seen = _seen | {(module, name)}
        tree, path, _ = self.module(module)
        for fallbacks in (False, True):
            for stmt in _statements(tree.body, fallbacks):
                if name in _targets(stmt) and not (isinstance(stmt, ast.AnnAssign) and stmt.value is None):  # `x: T` binds nothing
                    return Found(module, name, stmt, path, self.root)
                if isinstance(stmt, ast.ImportFrom):
                    for alias in stmt.names:
                        if (alias.asname or alias.name) == name:
                            source = self._absolute(module, stmt)
                            if self.is_module(f"{source}.{alias.name}") and source.startswith("vllm"):
                                return self._module_found(f"{source}.{alias.name}")
                            return self.resolve(source, alias.name, seen)
                if isinstance(stmt, ast.Import):
                    for alias in stmt.names:
                        if alias.asname == name:
                            return self._module_found(alias.name) if alias.name.startswith("vllm") else External(alias.name)
        lazy = self._lazy(tree, name)
        if lazy is not None:
            target, attr = lazy
            return self.resolve(importlib.util.resolve_name(target, self._package(module)), attr, seen)
        if self.is_module(f"{module}.{name}"):
            return self._module_found(f"{module}.{name}")
        read = path.relative_to(self.root).as_posix()
        raise NotFound(f"{module} defines no {name} (read {read}: no binding, import or lazy __getattr__ entry)")

    def _module_found(self, module: str) -> Found:
        tree, path, _ = self.module(module)
        return Found(module, module, tree, path, self.root)

    @staticmethod
    def _lazy(tree: ast.Module, name: str) -> tuple[str, str] | None:
        """``("module", "attribute")`` when the module has a ``__getattr__`` and a dict maps ``name`` to ``"module:attribute"``."""
        statements = _statements(tree.body, True)
        if not any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in statements):
            return None
        for stmt in statements:
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Dict):
                for key, target in zip(value.keys, value.values):
                    is_entry = isinstance(key, ast.Constant) and key.value == name and isinstance(target, ast.Constant)
                    if is_entry and ":" in str(target.value):
                        module, _, attr = str(target.value).partition(":")
                        return module, attr
        return None

    def lookup(self, dotted: str) -> Found:
        """``"vllm.x:Class.member"`` (or ``"vllm:LLM"``, a re-export) resolved to its definition."""
        module, _, path = dotted.partition(":")
        if not path:
            return self._module_found(module)
        first, *members = path.split(".")
        found = self.resolve(module, first)
        for member in members:
            found = self.member(found, member)
        return self._found(found, dotted)

    # ------------------------------------------------------------------ classes

    def bases(self, cls: Found) -> list[Found | External]:
        """The class's bases, resolved in its module (``Generic[T]`` is ``Generic``; a builtin is ``builtins.X``)."""
        assert isinstance(cls.node, ast.ClassDef), f"{cls.name} ({cls.where}) is not a class"
        out: list[Found | External] = []
        for base in cls.node.bases:
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name):
                try:
                    out.append(self.resolve(cls.module, base.id))
                except NotFound:  # a builtin (ValueError), or a name this reader cannot follow: said so in a chain it prints
                    out.append(External(f"builtins.{base.id}" if hasattr(builtins, base.id) else f"{cls.module}.{base.id} (unresolved)"))
            elif isinstance(base, ast.Attribute):
                out.append(External(ast.unparse(base)))
        return out

    def mro(self, cls: Found) -> list[Found | External]:
        """The class and its ancestors, depth-first, left to right, each once."""
        out: list[Found | External] = []
        stack: list[Found | External] = [cls]
        while stack:
            current = stack.pop(0)
            if current in out:
                continue
            out.append(current)
            if isinstance(current, Found) and isinstance(current.node, ast.ClassDef):
                stack = self.bases(current) + stack
        return out

    def member(self, cls: Found | External, name: str) -> Found:
        """The class attribute ``name`` (method, field, class variable) on the class or the first base defining it."""
        if isinstance(cls, External):
            raise NotFound(f"{cls.qualname} is outside vLLM: cannot read its member {name}")
        if isinstance(cls.node, ast.Module):
            return self._found(self.resolve(cls.module, name), f"{cls.module}.{name}")
        if not isinstance(cls.node, ast.ClassDef):
            raise NotFound(f"{cls.name} ({cls.where}) is not a class or module: no member {name}")
        for owner in self.mro(cls):
            if isinstance(owner, Found):
                hits = [s for s in owner.node.body if name in _targets(s)]
                if hits:
                    return Found(owner.module, f"{owner.name}.{name}", hits[-1], owner.path, self.root)
        chain = " -> ".join(o.name if isinstance(o, Found) else o.qualname for o in self.mro(cls))
        raise NotFound(f"{cls.name} ({cls.where}) has no member {name} (searched {chain})")

    @staticmethod
    def _found(found: Found | External, name: str) -> Found:
        if isinstance(found, External):
            raise NotFound(f"{name} is defined outside vLLM ({found.qualname})")
        return found

    def is_field_class(self, cls: Found) -> bool:
        """A dataclass, ``@config``, ``msgspec.Struct``, pydantic model or ``TypedDict``: its fields are its constructor."""
        for owner in self.mro(cls):
            if isinstance(owner, External):
                if owner.qualname.rpartition(".")[2] in FIELD_BASES:
                    return True
            elif any(_last_name(d) in FIELD_DECORATORS for d in owner.node.decorator_list):
                return True
        return False

    def fields(self, cls: Found) -> dict[str, Found]:
        """Annotated fields (not ``ClassVar``) of the class and its vLLM bases, base fields first."""
        out: dict[str, Found] = {}
        for owner in reversed(self.mro(cls)):
            if isinstance(owner, Found):
                for stmt in owner.node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not _is_classvar(stmt.annotation):
                        out[stmt.target.id] = Found(owner.module, f"{owner.name}.{stmt.target.id}", stmt, owner.path, self.root)
        return out

    # ------------------------------------------------------------------ signatures and text

    def signature(self, found: Found) -> inspect.Signature:
        """The parameters of a ``def`` (without ``cls`` for a classmethod), or of a class's constructor (with ``self``)."""
        node = found.node
        if isinstance(node, ast.ClassDef):
            return self._constructor(found)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise NotFound(f"{found.name} ({found.where}) is not a function")
        args = node.args
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        kind = inspect.Parameter
        params = [
            kind(a.arg, kind.POSITIONAL_ONLY if i < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD, default=_default(d))
            for i, (a, d) in enumerate(zip(positional, defaults))
        ]
        if args.vararg:
            params.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
        for a, d in zip(args.kwonlyargs, args.kw_defaults):
            params.append(kind(a.arg, kind.KEYWORD_ONLY, default=_default(d)))
        if args.kwarg:
            params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
        if any(_last_name(d) == "classmethod" for d in node.decorator_list):
            params = params[1:]
        return inspect.Signature(params)

    def _constructor(self, cls: Found) -> inspect.Signature:
        """An ``__init__`` found first through the bases, else a field class's fields as keyword arguments."""
        for owner in self.mro(cls):
            if isinstance(owner, External):
                continue
            if any("__init__" in _targets(s) for s in owner.node.body):
                return self.signature(self.member(owner, "__init__"))
        if not self.is_field_class(cls):
            raise NotFound(f"{cls.name} ({cls.where}): neither an __init__ nor fields found")
        optional = self._typed_dict_optional(cls)
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        keyword = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                              default=_Default(ast.unparse(f.node.value)) if f.node.value is not None
                              else _Default("<not required>") if name in optional else inspect.Parameter.empty)
            for name, f in self.fields(cls).items() if _field_in_init(f.node)
        ]  # fmt: skip
        return inspect.Signature([self_param, *keyword])

    def _typed_dict_optional(self, cls: Found) -> set[str]:
        """The keys a ``TypedDict`` may leave out: ``NotRequired[...]``, or declared in a ``total=False`` class."""
        optional = set()
        for owner in self.mro(cls):
            if isinstance(owner, Found) and isinstance(owner.node, ast.ClassDef):
                keywords = owner.node.keywords
                total = not any(k.arg == "total" and isinstance(k.value, ast.Constant) and k.value.value is False for k in keywords)
                for stmt in owner.node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        wrapper = _last_name(stmt.annotation) if isinstance(stmt.annotation, ast.Subscript) else ""
                        if wrapper == "NotRequired" or (not total and wrapper != "Required"):
                            optional.add(stmt.target.id)
        return optional

    def text(self, found: Found) -> str:
        """The definition's source text (a module's: the whole file)."""
        text = self.module(found.module)[2]
        return text if isinstance(found.node, ast.Module) else ast.get_source_segment(text, found.node) or ""

    def value(self, found: Found):
        """The literal value assigned (``X = 3``, ``__version__ = version = "0.33.0"``)."""
        node = found.node
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            raise NotFound(f"{found.name} ({found.where}) is not assigned a value")
        return ast.literal_eval(node.value)
