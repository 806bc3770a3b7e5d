"""Grade a patch on one instance: a fresh container from its image, network off; the model patch is applied
(``git apply``, else ``patch --fuzz=5`` as SWE-bench does), then the test patch; the spec's test command runs on
the test files the test patch touches; swebench's log parser reads the output and swebench decides: resolved
iff every FAIL_TO_PASS and PASS_TO_PASS test passes.

What the patch causes is ``fail`` with a code (``FAIL_CODES``, also a ``fail_<code>`` metric), never ``error``:
over ``max_patch_bytes``; a path outside the repository or in ``.git`` (refused before anything runs);
test-run tampering (:func:`prepare`); a patch that does not apply; a test patch that no longer applies after it;
a failed rebuild; a run past ``grade_timeout_s``, out of memory or killed once the patch is applied. Only what
the harness or Docker causes is ``error``. The grader's git commands run with hooks and fsmonitor off; the script
is ``bash -c``'s argument (no file the repository's code could rewrite), and the test patch is applied before any
code of the repository runs (after every path it touches is restored to the base commit, or removed where the
base lacks it).

Differences from SWE-bench's own eval script, all forced by the offline Python 3.11 images: no conda; the
spec's ``install`` is not re-run (the editable install of the image already sees the patched tree; compiled
extensions are rebuilt in place where the patch changes their sources and the spec can, :func:`rebuild_command`); the \
``locale-gen`` step of ``eval_commands`` cannot run (read-only root, not root) and is skipped, and
the locale it would make is replaced by ``C.UTF-8``. For instances whose spec asks for a Python older than 3.11
(their test lists were recorded with it), unittest's output is made to read as it did there: test names
``name (module.Class.name)`` are mapped back to ``name (module.Class)``, and a ``sitecustomize`` restores the old
``TestCase.shortDescription`` (the first docstring line *as written*, so a docstring that starts on a new line
gives no description and the test is reported under its name, as in SWE-bench's lists).
"""
from __future__ import annotations

import hashlib
import io
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from opd_harness.tasks.swebench import patches, steering, upstream
from opd_harness.tasks.swebench.images import TESTBED

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
APPLY_FAILED = ">>>>> Patch Apply Failed"
TEST_PATCH_FAILED = ">>>>> Test Patch Apply Failed"
APPLIED = ">>>>> Applied Patch"
# infrastructure (counted only before APPLIED: nothing of the patch has run then)
SETUP_FAILED = ">>>>> Grading Setup Failed"
TEST_PATCH_BROKEN = ">>>>> Test Patch Does Not Apply To The Base Commit"
# the patch's doing (after APPLIED)
TAMPERED = ">>>>> Test Tampering:"
STRIPPED = ">>>>> Stripped (test tampering):"
TEST_PATCH_APPLIED = ">>>>> Applied Test Patch"
INSTALL_FAILED = ">>>>> Install Failed"
FAIL_CODES = ("patch_too_large", "unsafe_path", "test_tampering", "patch_does_not_apply", "test_patch_conflict", "install_failed",
              "grade_timeout", "grade_oom", "grade_killed", "tests_did_not_run")  # fmt: skip
MAX_PATCH_BYTES = 2 << 20  # the default bound on a model patch (task option max_patch_bytes)
_UNITTEST_311 = re.compile(r"^(\S+) \((\S+)\.\1\)$")
INPUTS = "/tmp/opd"  # the bundle: the patches (read before any code of the repository runs), steering.py, compat/
COMPAT_DIR = f"{INPUTS}/compat"
STEERING_SOURCE = Path(steering.__file__).read_text()
# unittest.TestCase.shortDescription of Python < 3.11 (3.11 strips the docstring before taking its first line)
OLD_SHORT_DESCRIPTION = """\
import unittest


def _short_description(self):
    doc = self._testMethodDoc
    return doc and doc.split("\\n")[0].strip() or None


unittest.TestCase.shortDescription = _short_description
"""


def recorded_before_311(spec: Mapping) -> bool:
    """Whether the instance's test lists were recorded with a Python older than 3.11 (the spec's ``python``)."""
    try:
        major, minor = (int(x) for x in str(spec.get("python", "3.11")).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (3, 11)


@dataclass
class Outcome:
    """What grading one patch found. ``status`` is pass / fail / error (error: the harness could not grade); a fail the
    patch caused other than by its tests' results has a ``code`` (FAIL_CODES)."""

    status: str
    reason: str
    log_path: str = ""
    metrics: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    code: str = ""


def map_unittest_names(status: Mapping[str, str]) -> dict[str, str]:
    """``name (module.Class.name)`` (Python >= 3.11) -> ``name (module.Class)`` (SWE-bench's lists); others unchanged."""
    out = {}
    for name, value in status.items():
        m = _UNITTEST_311.match(name)
        out[f"{m.group(1)} ({m.group(2)})" if m else name] = value
    return out


def eval_commands(spec: Mapping) -> list[str]:
    """The spec's ``eval_commands`` that can run as the sandbox user: ``locale-gen`` is dropped, en_US.UTF-8 -> C.UTF-8."""
    out = []
    for cmd in spec.get("eval_commands", []):
        if "locale-gen" in cmd or "/etc/" in cmd:
            continue
        out.append(cmd.replace("en_US.UTF-8", "C.UTF-8").replace("en_US:en", "C.UTF-8"))
    return out


def quoted(paths: list[str]) -> str:
    return " ".join(shlex.quote(p) for p in paths)


REBUILD = "python setup.py build_ext --inplace"


def builds_in_place(install: str) -> bool:
    """Whether the spec's install is an editable build with the venv's own build tools (``--no-build-isolation``,
    ``setup.py develop``): its compiled extensions live in the tree and can be rebuilt offline there."""
    editable = re.search(r"(^|\s)(-e|--editable)(\s|$)", install) and "--no-build-isolation" in install
    return bool(editable or re.search(r"\bsetup\.py develop\b", install))


def rebuild_command(spec: Mapping, files: list[patches.FilePatch], policy: str) -> str | None:
    """The rebuild run after the patches (None: none), by ``policy``: ``auto`` when the patch changes compiled sources
    (``.pyx``, C, ...) and the spec builds them in place (:func:`builds_in_place`); ``always`` for every such spec;
    ``never``. It is ``setup.py build_ext --inplace``, not the spec's install: the grading container's root (and so
    the venv's site-packages) is read-only, and the editable install already points at the tree. An isolated build
    (astropy's ``pip install -e``) fetched its build tools into a throw-away environment when the image was built:
    it cannot run offline, so it is never re-run (and the base image has no C compiler: such images do not build)."""
    install = spec.get("install", "")
    if policy == "never" or not isinstance(install, str) or not builds_in_place(install):
        return None
    return REBUILD if policy == "always" or patches.compiles(files) else None


def eval_script(row: Mapping, spec: Mapping, *, sectioned: list[str] = (), tampering: str = "fail", install: str | None = None) -> str:
    """The bash script run in the container (held in memory as ``bash -c``'s argument, never in a file the
    instance's code could rewrite). Order: unpack the inputs, check that the test patch applies to the base, apply
    the model patch, compare the test sections of ``sectioned`` files (fail or restore them, by ``tampering``),
    restore every path of the test patch to the base commit (removed where the base lacks it), apply the test
    patch -- all before any code of the repository runs -- then the spec's environment, the rebuild (if any;
    the test-run files are hashed before it and checked after it), and the tests."""
    test_paths = patches.touched(patches.parse_patch(row["test_patch"]))
    test_cmd = " ".join([spec["test_cmd"], *upstream.test_directives(row)])
    git = patches.GIT
    guarded = " -o ".join(f"-name {shlex.quote(n)}" for n in (*sorted(patches.STEERING_NAMES | patches.SECTIONED_NAMES), "*.pth"))
    manifest = (f"{{ find . -path ./.git -prune -o \\( -type f -o -type l \\) \\( {guarded} \\) -print0"
                " | LC_ALL=C sort -z | xargs -0 -r sha256sum;"
                f" sha256sum -- {quoted(test_paths + patches.settings_files(spec['test_cmd']))}; }} 2>&1")  # fmt: skip
    lines = [
        "set -uo pipefail",
        "export HOME=/tmp",
        f"mkdir -p {INPUTS} && tar -x -C {INPUTS} || {{ echo '{SETUP_FAILED}'; exit 10; }}",
        f"cd {TESTBED} || {{ echo '{SETUP_FAILED}'; exit 10; }}",
        "git config --global --add safe.directory '*'",
        f"{git} apply --check {INPUTS}/test.patch || {{ echo '{TEST_PATCH_BROKEN}'; exit 11; }}",
        f"if [ -s {INPUTS}/model.patch ]; then",
        f"  if {git} apply -v {INPUTS}/model.patch; then :;",
        f"  elif [ -s {INPUTS}/fuzz.patch ] && patch --batch --fuzz=5 -p1 --no-backup-if-mismatch -i {INPUTS}/fuzz.patch; then :;",
        f"  else echo '{APPLY_FAILED}'; exit 3; fi",
        "fi",
        f"echo '{APPLIED}'",
    ]
    if sectioned and tampering != "off":
        lines += [f"changed=$(/usr/bin/python3 -I -S {INPUTS}/steering.py {quoted(list(sectioned))})"]
        if tampering == "fail":
            lines += [f'if [ -n "$changed" ]; then echo "{TAMPERED} $(echo $changed)"; exit 5; fi']
        else:
            lines += [f'for p in $changed; do echo "{STRIPPED} $p"; {git} checkout -q HEAD -- "$p"; done']
    lines += [
        f"for p in {quoted(test_paths)}; do",
        f'  if {git} cat-file -e "HEAD:$p" 2>/dev/null; then {git} checkout -q HEAD -- "$p"; else rm -rf -- "$p"; fi',
        "done",
        f"{git} apply -v {INPUTS}/test.patch || {{ echo '{TEST_PATCH_FAILED}'; exit 4; }}",
        f"echo '{TEST_PATCH_APPLIED}'",
        *eval_commands(spec),
        *([f"export PYTHONPATH={COMPAT_DIR}${{PYTHONPATH:+:$PYTHONPATH}}"] if recorded_before_311(spec) else []),
    ]
    if install:
        lines += [
            f"before=$({manifest})",
            f"( {install} ) </dev/null 2>&1 || {{ echo '{INSTALL_FAILED}'; exit 6; }}",
            f'[ "$({manifest})" = "$before" ] || {{ echo "{TAMPERED} (changed by the install)"; exit 5; }}',
        ]
    lines += [f"echo '{START}'", f"{test_cmd} </dev/null 2>&1", f"echo '{END}'"]
    return "\n".join(lines) + "\n"


def stdin_bundle(files: Mapping[str, str]) -> bytes:
    """A tar of ``{name: text}``, given to the container on stdin and unpacked into ``/tmp/opd``."""
    buf = io.BytesIO()
    import tarfile  # with the first archive: `harness tasks` does not load it

    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, text in files.items():
            data = text.encode(errors="surrogateescape")
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_section(log: str) -> str | None:
    """The test command's output: from the last start marker line (the grader's, printed after the install, whose
    output may hold a fake one) to the first end marker line after it (None when the tests never started)."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line == START]
    if not starts:
        return None
    body = lines[starts[-1] + 1 :]
    end = body.index(END) if END in body else len(body)
    return "\n".join(body[:end]) + "\n"


def decide(row: Mapping, log: str) -> tuple[str, str, dict]:
    """(pass/fail, reason, swebench report) from the eval log."""
    section = test_section(log)
    if section is None:
        return "fail", "the tests did not run", {}
    status = upstream.parser_of(row["repo"])(section, None)
    if recorded_before_311(upstream.spec_of(row["repo"], row["version"])):
        status = map_unittest_names(status)
    verdict, report = upstream.resolution(status, row["FAIL_TO_PASS"], row["PASS_TO_PASS"])
    f2p, p2p = report.get("FAIL_TO_PASS", {}), report.get("PASS_TO_PASS", {})
    summary = (
        f"FAIL_TO_PASS {len(f2p.get('success', []))}/{len(row['FAIL_TO_PASS'])}, "
        f"PASS_TO_PASS {len(p2p.get('success', []))}/{len(row['PASS_TO_PASS'])}"
    )
    return ("pass" if verdict == "RESOLVED_FULL" else "fail"), f"{verdict}: {summary}", report


def patch_key(patch: str) -> str:
    return hashlib.sha256(patch.encode(errors="surrogateescape")).hexdigest()[:12]


def failed(code: str, reason: str, log_path: str = "", metrics: Mapping | None = None) -> Outcome:
    """A fail the patch caused: ``code`` (one of FAIL_CODES) is in the reason and is a metric of its own."""
    return Outcome("fail", f"{code}: {reason}", log_path, {**(metrics or {}), f"fail_{code}": 1.0}, code=code)


def too_large(patch: str, max_bytes: int) -> Outcome | None:
    """The fail of a patch over ``max_bytes`` (UTF-8), decided before anything is parsed or built; None when it fits."""
    size = len(patch) if len(patch) > max_bytes else len(patch.encode(errors="surrogateescape"))  # a character is at least a byte
    if size <= max_bytes:
        return None
    return failed("patch_too_large",
                  f"the patch is {size:,} bytes or more, over the {max_bytes:,}-byte limit (task option max_patch_bytes)",
                  metrics={"patch_applied": 0.0})  # fmt: skip


@dataclass(frozen=True)
class Prepared:
    """A model patch checked before grading: what ``git apply`` and ``patch --fuzz`` get, or why it is refused."""

    patch: str = ""
    fuzz: str = ""
    files: tuple = ()
    sectioned: tuple[str, ...] = ()
    stripped: tuple[str, ...] = ()
    refused: Outcome | None = None


def prepare(patch: str, spec: Mapping, test_patch: str, *, tampering: str = "fail", max_bytes: int = MAX_PATCH_BYTES) -> Prepared:
    """Refuse what may never be applied (over ``max_bytes``; a path outside the repository or in ``.git``) and apply
    the tampering policy to files that steer the test run: ``fail`` refuses the patch, ``strip`` drops their
    sections, ``off`` keeps them. Files the test patch touches are no tampering: they are restored before it."""
    oversized = too_large(patch, max_bytes)
    if oversized is not None:
        return Prepared(refused=oversized)
    files = patches.parse_patch(patch)
    bad = patches.unsafe_paths(files)
    if bad:
        return Prepared(refused=failed("unsafe_path", "the patch writes outside the repository's tracked tree: " + "; ".join(bad[:5])))
    restored = set(patches.touched(patches.parse_patch(test_patch)))
    steering = [p for p in patches.steering_paths(files, spec) if p not in restored] if tampering != "off" else []
    if steering and tampering == "fail":
        return Prepared(refused=failed("test_tampering", "the patch changes files that steer the test run: " + ", ".join(steering[:10])))
    if steering:
        patch = patches.without(files, set(steering))
        files = patches.parse_patch(patch)
    sectioned = tuple(p for p in patches.sectioned_paths(files) if p not in restored)
    return Prepared(patch, patches.fuzz_patch(files), tuple(files), sectioned, tuple(steering))


def classify(row: Mapping, result, log: str, timeout_s: float, metrics: dict, log_path: str, *, applies: bool = True) -> Outcome:
    """The outcome of one grading run from its status and the marker lines of its log. Markers count only where the
    grader prints them: the ones meaning an infrastructure failure only before the model patch is applied (nothing of
    the patch has run then); after that, whatever stops the run (time-out, OOM, a kill, a test patch that no longer
    applies, a failed rebuild) is the patch's doing: ``fail`` with its code. ``applies``: the run had a model patch to apply."""
    if result.status == "error":
        return Outcome("error", f"sandbox error: {result.error}", log_path, metrics)
    lines = result.stdout.splitlines()
    before = lines[: lines.index(APPLIED)] if APPLIED in lines else lines  # printed by the grader, not the patch's code
    if APPLY_FAILED in before:
        metrics["patch_applied"] = 0.0
        return failed("patch_does_not_apply", "the patch does not apply (git apply and patch --fuzz=5 both failed)", log_path, metrics)
    if APPLIED not in lines:
        why = "the instance's test patch does not apply to its base commit" if TEST_PATCH_BROKEN in lines else "setup failed"
        return Outcome(
            "error", f"grading stopped before the patch was applied: {why} ({result.status}, exit {result.exit_code})", log_path, metrics
        )
    metrics["patch_applied"] = float(applies)
    after = lines[lines.index(APPLIED) + 1 :]
    tampered = next((line for line in after if line.startswith(TAMPERED)), None)
    if tampered is not None:
        return failed(
            "test_tampering", f"the patch changes what steers the test run: {tampered[len(TAMPERED):].strip()}", log_path, metrics
        )
    if TEST_PATCH_FAILED in after:
        return failed("test_patch_conflict", "the test patch no longer applies after the model patch", log_path, metrics)
    if INSTALL_FAILED in after:
        return failed("install_failed", f"the rebuild ({REBUILD}) failed on the patched tree", log_path, metrics)
    if result.status == "timeout":
        return failed("grade_timeout", f"the grading run went past {timeout_s:g}s (task option grade_timeout_s)", log_path, metrics)
    if result.status in ("oom", "killed"):
        return failed(
            f"grade_{result.status}",
            f"the grading run was {result.status} ({result.error or 'after the patch was applied'})",
            log_path,
            metrics,
        )
    status, reason, report = decide(row, log)
    if status == "fail" and test_section(log) is None:
        return failed("tests_did_not_run", reason, log_path, metrics)
    return Outcome(status, reason, log_path, metrics, report)


def grade_patch(row: Mapping, patch: str, image: str, log_dir: Path, *, timeout_s: float = 1800.0, memory_mb: int = 4096, cpus: float = 2.0,
                tampering: str = "fail", max_patch_bytes: int = MAX_PATCH_BYTES, rebuild: str = "auto") -> Outcome:
    """Grade ``patch`` on instance ``row`` in a fresh container of ``image``; the log goes to ``log_dir/<id>/<patch hash>.log``.

    Never raises for what the patch or the tests do: what the patch causes is ``fail`` (see :func:`classify`);
    an infrastructure failure (Docker, image, a test patch that does not fit its base) is ``error``."""
    from opd_harness import sandbox

    log_path = Path(log_dir) / row["instance_id"] / f"{patch_key(patch)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    empty = not patch.strip()
    metrics = {"empty_patch": float(empty), "patch_bytes": float(len(patch.encode(errors="surrogateescape")))}
    try:
        spec = upstream.spec_of(row["repo"], row["version"])
    except (KeyError, upstream.SwebenchMissing) as exc:
        log_path.write_text(f"cannot grade: {exc}\n")
        return Outcome("error", str(exc), str(log_path), metrics)
    prepared = prepare(patch, spec, row["test_patch"], tampering=tampering, max_bytes=max_patch_bytes)
    if prepared.refused is not None:
        log_path.write_text(f"refused before grading: {prepared.refused.reason}\n")
        refused = prepared.refused
        return Outcome(
            refused.status, refused.reason, str(log_path), {**metrics, "patch_applied": 0.0, **refused.metrics}, code=refused.code
        )
    if prepared.stripped:
        metrics["stripped_files"] = float(len(prepared.stripped))
    install = rebuild_command(spec, list(prepared.files), rebuild) if prepared.patch.strip() else None
    try:
        script = eval_script(row, spec, sectioned=list(prepared.sectioned), tampering=tampering, install=install)
    except (KeyError, upstream.SwebenchMissing) as exc:
        log_path.write_text(f"cannot grade: {exc}\n")
        return Outcome("error", str(exc), str(log_path), metrics)
    text = prepared.patch if prepared.patch.endswith("\n") or not prepared.patch else prepared.patch + "\n"
    files = {"model.patch": text, "fuzz.patch": prepared.fuzz, "test.patch": row["test_patch"], "steering.py": STEERING_SOURCE,
             "compat/sitecustomize.py": OLD_SHORT_DESCRIPTION}  # fmt: skip
    started = time.perf_counter()
    sb = sandbox.open_sandbox("docker", image=image, tmpfs_mb=1024, http_timeout_s=timeout_s + 120, retries=1)
    try:
        try:
            session = sb.session(memory_mb=memory_mb, cpus=cpus, pids=1024, network=False)
        except sandbox.SandboxUnavailable as exc:
            log_path.write_text(f"sandbox unavailable: {exc}\n")
            return Outcome("error", f"sandbox unavailable: {exc}", str(log_path), metrics)
        with session:
            request = sandbox.ExecRequest(argv=["bash", "-c", script], stdin=stdin_bundle(files), timeout_s=timeout_s,
                                          memory_mb=memory_mb, cpus=cpus, pids=1024, max_output_bytes=32 << 20,
                                          env={"HOME": "/tmp", "PIP_NO_INDEX": "1"})  # fmt: skip
            result = session.run(request)
    finally:
        sb.close()
    log = result.stdout + ("\n--- stderr ---\n" + result.stderr if result.stderr else "")
    metrics["container_s"] = time.perf_counter() - started  # this grading container, from start to log
    stripped = "".join(f"# stripped (tampering policy strip): {p}\n" for p in prepared.stripped)
    log_path.write_text(
        f"# image {image}\n# status {result.status} exit {result.exit_code} ({result.duration_s:.1f}s)\n{stripped}{log}", encoding="utf-8"
    )
    return classify(row, result, log, timeout_s, metrics, str(log_path), applies=bool(prepared.patch.strip()))
