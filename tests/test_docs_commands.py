"""Every ``harness`` command the documents show parses against the real CLI, and the short ones run.

What is a documented command: a line of a fenced ```` ```bash ````, ```` ```sh ````, ```` ```shell ```` or
```` ```console ```` block in README.md or docs/**/*.md (in a ``console`` block only the lines after a ``$ `` prompt;
the rest is output). Lines ending in ``\\`` continue on the next line; ``#`` starts a comment; ``&&``, ``;``, ``|``
and ``&`` separate commands; ``VAR=value`` words before the program are environment, not arguments. A command is one
whose program is ``harness`` (or a path ending in ``/harness``, like ``.venv/bin/harness``) or ``python -m
opd_harness``.

Placeholders, so that a documented command need not be runnable to be checked:

- a word in angle brackets (``<path>``) is a value, the bracketed name;
- an upper-case word (``MODEL``, ``DIR``, ``RUN_ID``) is a value like any other; it is only a problem where the
  option wants a number, which a document should then show;
- a shell expansion (``$VAR``, ``"$(cat f)"``) is a value where an option expects one, and zero or more words
  elsewhere (it is dropped);
- ``...`` stands for more arguments and is dropped; a redirection (``> f``, ``2>&1``) is dropped with its target.

Each command is resolved down the Typer app's groups (``harness data fetch``) and parsed with click's
``make_context`` (``resilient_parsing=False``): an unknown sub-command, option or choice, or a missing value, fails
with the file, line and command. Nothing is run by the parse; the run test below runs only the short commands
(``--help``, ``tasks``, ``methods``, ``--print-config``, ``--dry-run``) in a subprocess, offline, with
``HARNESS_DATA_DIR`` (and any ``--data-dir``) where the tests read benchmark data (``tests/conftest.py``) and
``results/`` moved to a temporary folder; one that needs the hub is skipped with the reason (``NEEDS``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer import Exit

try:  # Typer 0.2x carries its own click; older ones use click itself
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - depends on the installed Typer
    from click.exceptions import UsageError

from conftest import benchmark_data_dir

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```\s*([\w-]*)")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
ANGLE = re.compile(r"<([\w.:/-]+)>")
MENTIONS = re.compile(r"(^|[\s/])harness\b|opd_harness")
SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}
DUP = re.compile(r"\s\d*>&\d+|\s\d+(?=>)")
REDIRECT = {">", ">>", "<", "&>"}
SHORT = ("--help", "--print-config", "--dry-run")
# what a short documented command needs that a test machine may lack: (a word of the command, why it is skipped)
NEEDS = (
    ("paper", "the paper-scale dry runs take 10-20 s each; tests/test_paper_dry_run.py runs every recipe's offline"),
)


@dataclass(frozen=True)
class DocCommand:
    """One documented ``harness`` invocation: where it is and its arguments after the program."""

    page: str
    line: int
    text: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def shell_lines(text: str) -> list[tuple[int, str]]:
    """The logical command lines of a page's shell blocks, as (first line number, text with continuations joined)."""
    out: list[tuple[int, str]] = []
    lang: str | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            lang = (fence.group(1) or "text") if lang is None else None
            pending = None
            continue
        if lang not in SHELLS:
            continue
        if pending is None:
            stripped = line.strip()
            if lang == "console":
                if not stripped.startswith("$ "):
                    continue
                stripped = stripped[2:]
            pending = (number, "")
        else:
            stripped = line.strip()
        start, joined = pending
        if stripped.endswith("\\"):
            pending = (start, joined + stripped[:-1] + " ")
            continue
        out.append((start, joined + stripped))
        pending = None
    return out


def _words(text: str) -> list[str]:
    text = DUP.sub(" ", ANGLE.sub(r"\1", text))  # <dir> -> dir; 2>&1 -> nothing; 2> f -> > f
    lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _segments(words: list[str]) -> list[list[str]]:
    segments, current = [], []
    for word in words:
        if word in SEPARATORS:
            segments.append(current)
            current = []
        else:
            current.append(word)
    return [*segments, current]


def harness_args(segment: list[str]) -> list[str] | None:
    """The arguments of ``harness ...`` / ``python -m opd_harness ...`` in one simple command, else None."""
    words = list(segment)
    while words and ENV.match(words[0]):
        words.pop(0)
    if not words:
        return None
    program = words[0]
    if program == "harness" or program.endswith("/harness"):
        rest = words[1:]
    elif re.fullmatch(r"(.*/)?python3?", program) and words[1:3] in (["-m", "opd_harness"], ["-m", "opd_harness.cli"]):
        rest = words[3:]
    else:
        return None
    args, skip = [], False
    for word in rest:
        if skip:
            skip = False
        elif word in REDIRECT:
            skip = True
        elif word != "...":
            args.append(word)
    return args


def documented_commands() -> list[DocCommand]:
    """Every ``harness`` command in the shell blocks of README.md and the site's pages."""
    found = []
    for page in PAGES:
        for number, text in shell_lines(page.read_text(encoding="utf-8")):
            if not MENTIONS.search(text):
                continue
            try:
                words = _words(text)
            except ValueError as error:  # an unclosed quote: a broken documented command
                raise AssertionError(f"{page.relative_to(ROOT)}:{number}: {text}\n  -> {error}") from None
            for segment in _segments(words):
                args = harness_args(segment)
                if args is not None:
                    found.append(DocCommand(str(page.relative_to(ROOT)), number, text, tuple(args)))
    return found


def _takes_value(command, word: str) -> bool:
    for param in command.params:
        if param.param_type_name == "option" and word in (*param.opts, *param.secondary_opts):
            return not param.is_flag and not param.count
    return False


def _drop_expansions(command, args: list[str]) -> list[str]:
    """``$VAR`` / ``$(...)`` words: kept as an option's value, dropped elsewhere (they may expand to nothing)."""
    kept: list[str] = []
    for word in args:
        if "$" in word and not (kept and _takes_value(command, kept[-1])):
            continue
        kept.append(word)
    return kept


def parse(args: list[str]) -> str:
    """Parse ``harness ARGS`` against the app without running it; the resolved command's name (``harness data fetch``).

    Raises click's ``UsageError`` (unknown command or option, bad choice, missing value) like the command line would."""
    import typer.main

    from opd_harness.cli import app

    command = typer.main.get_command(app)
    name, parent, rest = "harness", None, list(args)
    while True:
        if not getattr(command, "commands", None):  # a leaf: its options tell where an expansion is a value
            rest = _drop_expansions(command, rest)
        try:
            ctx = command.make_context(name.split()[-1], list(rest), parent=parent, resilient_parsing=False)
        except Exit:  # --help (and other eager exits) parse fine
            return name
        if not getattr(command, "commands", None):  # a leaf command
            return name
        remaining = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not remaining:
            return name
        sub_name, sub, rest = command.resolve_command(ctx, remaining)
        if sub is None:
            raise UsageError(f"no such command {remaining[0]!r}", ctx)
        name, parent, command = f"{name} {sub_name}", ctx, sub


def is_short(command: DocCommand) -> bool:
    """A command cheap enough to run in the tests: help, the listings, or one that only plans."""
    args = command.args
    return bool(args) and (any(a in SHORT for a in args) or args[0] in ("tasks", "methods") or args == ("--help",))


COMMANDS = documented_commands()
SHORT_COMMANDS = [c for c in COMMANDS if is_short(c)]


def test_the_documents_show_harness_commands_in_every_form() -> None:
    """The extraction finds what it must: prompts, environment prefixes, continuations, paths to the program."""
    assert len(COMMANDS) >= 60
    assert any(c.page.startswith("docs/") and c.text.startswith("OMP_NUM_THREADS=") for c in COMMANDS)
    assert any("\\" in line for c in COMMANDS for line in [(ROOT / c.page).read_text().splitlines()[c.line - 1]])
    sample = "```console\n$ FOO=1 .venv/bin/harness run --preset smoke \\\n    --out <dir> 2>&1 | tee x   # note\nout\n```\n"
    [(line, text)] = shell_lines(sample)
    [args] = [a for s in _segments(_words(text)) if (a := harness_args(s)) is not None]
    assert line == 2 and args == ["run", "--preset", "smoke", "--out", "dir"]
    assert harness_args(["python", "-m", "opd_harness", "tasks"]) == ["tasks"]
    assert harness_args(["pip", "install", "opd-harness"]) is None


def test_the_parse_rejects_what_the_command_line_rejects() -> None:
    assert parse(["data", "fetch", "math500", "--to", "data"]) == "harness data fetch"
    assert parse(["eval", "--help"]) == "harness eval"
    for bad in (["run", "--no-such-flag"], ["evaluate"], ["data", "fetchh"], ["eval", "--k"]):
        with pytest.raises(UsageError):
            parse(bad)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_documented_command_parses(command: DocCommand) -> None:
    try:
        parse(list(command.args))
        return
    except UsageError as error:
        message = error.format_message()
    pytest.fail(f"{command}\n  -> {message}", pytrace=False)


def _needs(command: DocCommand) -> str | None:
    return next((why for word, why in NEEDS if word in command.args), None)


@pytest.mark.parametrize("command", SHORT_COMMANDS, ids=str)
def test_the_short_documented_commands_run(command: DocCommand, tmp_path: Path) -> None:
    why = _needs(command)
    if why:
        pytest.skip(f"{command}: {why}")
    env = {**os.environ, "HARNESS_DATA_DIR": str(benchmark_data_dir()), "HF_HUB_OFFLINE": "1"}
    args = [a.replace("results/", f"{tmp_path}/") for a in command.args]  # a run folder never lands in the checkout
    args = [str(env["HARNESS_DATA_DIR"]) if prev == "--data-dir" else a for prev, a in zip(["", *args], args)]
    done = subprocess.run([sys.executable, "-m", "opd_harness", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"{command}\n  -> exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
