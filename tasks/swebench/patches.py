"""What a model patch may touch before it is graded: its files parsed from the diff, paths that leave the repository
(refused), files that steer the test run (the tampering guard), and the plain unified diff given to ``patch --fuzz``.

The parser reads git's and plain unified diffs as ``git apply`` and GNU ``patch`` do: a file section starts at
``diff --git`` or at a ``---``/``+++`` pair, and a hunk's body is read by its header's line counts (a removed line
``--- x`` inside a hunk is no file header). Paths are taken from every place either tool reads them (the
``diff --git`` line, ``---``/``+++``, ``rename``/``copy`` lines), C-quoted names unquoted, ``a/``/``b/`` stripped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\", '"': '"'}
# Files whose change steers pytest/unittest/django's runner rather than the code under test (any directory).
STEERING_NAMES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "sitecustomize.py", "usercustomize.py"})
STEERING_SUFFIXES = (".pth",)
# Files where only some sections steer the test run (``[tool:pytest]``, ``[tool.pytest.ini_options]``, pytest11
# entry points): compared section by section in the container (tasks/swebench/steering.py).
SECTIONED_NAMES = frozenset({"setup.cfg", "pyproject.toml"})
# git as the grader and the agent's patch collection run it: no hooks, no fsmonitor, paths printed as they are
GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.quotepath=false"
COMPILED_SUFFIXES = (".pyx", ".pxd", ".pxi", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".f", ".f90", ".pyf")


@dataclass
class FilePatch:
    """One file's section of a diff: its old and new path (None for /dev/null), raw text, and unified hunks."""

    old: str | None = None
    new: str | None = None
    raw: list[str] = field(default_factory=list)  # every line of the section, as given
    hunks: list[list[str]] = field(default_factory=list)  # each hunk: its header line, then its body lines
    paths: set[str] = field(default_factory=set)  # every path the section names, wherever it names it
    symlink: bool = False  # creates or keeps a symbolic link (mode 120000)
    headers: bool = False  # has its ``---``/``+++`` lines
    created: bool = False  # ``new file mode`` (a git section without ``---``/``+++``: an empty or binary file)
    deleted: bool = False
    moved: tuple[str | None, str | None] = (None, None)  # ``rename``/``copy`` from and to

    @property
    def path(self) -> str:
        return self.new or self.old or ""


def unquote(name: str) -> str:
    """A git C-quoted path (``"a/b\\tc"``) as text; an unquoted name unchanged, less a trailing timestamp after a tab."""
    if not name.startswith('"'):
        return name.split("\t", 1)[0].rstrip("\r")
    raw, i = bytearray(), 1
    while i < len(name) and name[i] != '"':
        if name[i] == "\\" and i + 1 < len(name):
            if name[i + 1] in "01234567":
                raw.append(int(name[i + 1 : i + 4], 8) & 0xFF)
                i += 4
                continue
            raw.extend(_ESCAPES.get(name[i + 1], name[i + 1]).encode())
            i += 2
            continue
        raw.extend(name[i].encode())
        i += 1
    return raw.decode("utf-8", errors="surrogateescape")


def strip_prefix(name: str) -> str | None:
    """``a/x`` / ``b/x`` → ``x``; ``/dev/null`` → None; other names as given (GNU patch's -p1 strips one component)."""
    name = unquote(name)
    if name == "/dev/null":
        return None
    if name.startswith(("a/", "b/")):
        return name[2:]
    return name.split("/", 1)[1] if "/" in name and not name.startswith("/") else name


def _git_header_paths(rest: str) -> list[str]:
    """The two names of ``diff --git A B`` (quoted or not; ambiguous names with spaces: both readings)."""
    if rest.startswith('"'):
        end = rest.index('"', 1) + 1 if '"' in rest[1:] else len(rest)
        return [rest[:end], rest[end:].strip()]
    if " b/" in rest:
        a, b = rest.split(" b/", 1)
        return [a, "b/" + b]
    return rest.split(" ", 1)


def parse_patch(text: str) -> list[FilePatch]:
    """The file sections of a unified diff (git or plain), hunks read by their line counts."""
    lines = text.splitlines()
    files: list[FilePatch] = []
    current: FilePatch | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            current = FilePatch(raw=[line])
            files.append(current)
            current.paths.update(p for p in (strip_prefix(n) for n in _git_header_paths(line[len("diff --git ") :])) if p)
            i += 1
            continue
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if current is None or current.hunks or current.headers:
                current = FilePatch()
                files.append(current)
            current.raw += [line, lines[i + 1]]
            current.headers = True
            current.old, current.new = strip_prefix(line[4:]), strip_prefix(lines[i + 1][4:])
            current.paths.update(p for p in (current.old, current.new) if p)
            i += 2
            continue
        match = HUNK.match(line)
        if match and current is not None:
            old_left = int(match.group(2) if match.group(2) is not None else 1)
            new_left = int(match.group(4) if match.group(4) is not None else 1)
            hunk = [line]
            i += 1
            while i < len(lines) and (old_left > 0 or new_left > 0 or lines[i].startswith("\\")):
                body = lines[i]
                kind = body[:1]
                if kind in (" ", ""):
                    old_left, new_left = old_left - 1, new_left - 1
                elif kind == "-":
                    old_left -= 1
                elif kind == "+":
                    new_left -= 1
                elif kind != "\\":
                    break
                hunk.append(body)
                i += 1
            current.hunks.append(hunk)
            current.raw += hunk
            continue
        if current is not None:
            current.raw.append(line)
            for key in ("rename from ", "rename to ", "copy from ", "copy to "):
                if line.startswith(key):
                    name = unquote(line[len(key) :])
                    current.paths.add(name)
                    current.moved = (name, current.moved[1]) if key.endswith("from ") else (current.moved[0], name)
            if re.match(r"^(new file mode|new mode|old mode|deleted file mode|index \S+) .*120000\b", line):
                current.symlink = True
            current.created |= line.startswith("new file mode")
            current.deleted |= line.startswith("deleted file mode")
        i += 1
    for f in files:
        if not f.headers and f.paths:
            path = sorted(f.paths)[-1]
            f.old, f.new = (None if f.created else f.moved[0] or path), (None if f.deleted else f.moved[1] or path)
    return files


def touched(files: Iterable[FilePatch]) -> list[str]:
    """Every path the patch names (old and new names), sorted."""
    return sorted({p for f in files for p in f.paths})


def unsafe_path(path: str) -> str | None:
    """Why a patch may not write ``path`` (absolute, ``..``, ``.git``, empty, a control character: a newline would
    let a name print a marker line into the log), or None when it may."""
    if not path or re.search(r"[\x00-\x1f\x7f]", path):
        return "an empty path or a control character"
    if path.startswith("/") or path.startswith("~"):
        return "an absolute path"
    parts = PurePosixPath(path).parts
    if ".." in parts or "." in path.split("/"):
        return "a path with '..' or '.' components"
    if any(part.lower() == ".git" for part in parts):
        return "a path inside .git"
    return None


def link_targets(f: FilePatch) -> list[str]:
    """The targets a symbolic-link section gives its link (the added lines of its hunks)."""
    return [line[1:] for hunk in f.hunks for line in hunk[1:] if line.startswith("+")] if f.symlink else []


def unsafe_paths(files: list[FilePatch]) -> list[str]:
    """``path: why`` for each path of the patch that leaves the repository or enters ``.git``, and each symbolic link
    that points there."""
    bad = [f"{p}: {why}" for p in touched(files) if (why := unsafe_path(p))]
    for f in files:
        bad += [f"{f.path} -> {t}: a link to {why}" for t in link_targets(f) if (why := unsafe_path(t))]
    return bad


def settings_files(test_cmd: str) -> list[str]:
    """Django's runner and the settings module its test command names (``--settings=test_sqlite`` → tests/test_sqlite.py)."""
    out = []
    if "runtests.py" in test_cmd:
        out.append("tests/runtests.py")
    for module in re.findall(r"--settings[= ](\S+)", test_cmd):
        out.append(f"tests/{module.replace('.', '/')}.py")
    return out


def steering(path: str, spec: Mapping) -> bool:
    """Whether a change to ``path`` steers the test run as a whole (see STEERING_NAMES, settings_files)."""
    name = PurePosixPath(path).name
    return name in STEERING_NAMES or name.endswith(STEERING_SUFFIXES) or path in settings_files(str(spec.get("test_cmd", "")))


def steering_paths(files: Iterable[FilePatch], spec: Mapping) -> list[str]:
    """The patch's paths that steer the test run (whole files; setup.cfg/pyproject.toml are checked by section later)."""
    return [p for p in touched(files) if steering(p, spec)]


def sectioned_paths(files: Iterable[FilePatch]) -> list[str]:
    """The patch's setup.cfg / pyproject.toml files (their test sections are compared in the container)."""
    return [p for p in touched(files) if PurePosixPath(p).name in SECTIONED_NAMES]


def compiles(files: Iterable[FilePatch]) -> bool:
    """Whether the patch changes a source file that a build compiles (Cython, C/C++, Fortran)."""
    return any(p.endswith(COMPILED_SUFFIXES) for p in touched(files))


def without(files: list[FilePatch], drop: set[str]) -> str:
    """The patch text without the sections that name any path in ``drop`` (the ``strip`` tampering policy)."""
    kept = [f for f in files if not (f.paths & drop)]
    return "".join("\n".join(f.raw) + "\n" for f in kept)


def _quote(path: str) -> str:
    """A name as a diff header gives it: C-quoted when it holds a space, quote, backslash or control character."""
    if not re.search(r'[\s"\\\x00-\x1f\x7f]', path):
        return path
    escaped = path.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t").replace("\n", "\\n")
    return f'"{escaped}"'


def fuzz_patch(files: Iterable[FilePatch]) -> str:
    """The plain unified diff given to ``patch --fuzz``: ``---``/``+++`` and hunks only, for the parsed paths, so
    that ``patch`` writes exactly what was checked (no ``Index:`` lines, ed scripts, git headers or modes)."""
    out = []
    for f in files:
        if not f.hunks:
            continue
        out.append(f"--- {'/dev/null' if f.old is None else _quote('a/' + f.old)}")
        out.append(f"+++ {'/dev/null' if f.new is None else _quote('b/' + f.new)}")
        for hunk in f.hunks:
            out += hunk
    return "\n".join(out) + "\n" if out else ""
