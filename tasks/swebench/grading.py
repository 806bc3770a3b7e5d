"""Grade a patch on one instance: a fresh container from its image, network off; the model patch is applied
(``git apply``, else ``patch --fuzz=5`` as SWE-bench does), then the test patch; the spec's test command runs on
the test files the test patch touches; swebench's log parser reads the output and swebench decides: resolved
iff every FAIL_TO_PASS and PASS_TO_PASS test passes.

Differences from SWE-bench's own eval script, all forced by the offline Python 3.11 images: no conda; the
spec's ``install`` is not re-run (the editable install of the image already sees the patched tree); the
``locale-gen`` step of ``eval_commands`` cannot run (read-only root, not root) and is skipped, and the locale it
would make is replaced by ``C.UTF-8``. For instances whose spec asks for a Python older than 3.11 (their test
lists were recorded with it), unittest's output is made to read as it did there: test names
``name (module.Class.name)`` are mapped back to ``name (module.Class)``, and a ``sitecustomize`` restores the old
``TestCase.shortDescription`` (the first docstring line *as written*, so a docstring that starts on a new line
gives no description and the test is reported under its name, as in SWE-bench's lists).
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tasks.swebench import upstream
from tasks.swebench.images import TESTBED

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
APPLY_FAILED = ">>>>> Patch Apply Failed"
TEST_PATCH_FAILED = ">>>>> Test Patch Apply Failed"
APPLIED = ">>>>> Applied Patch"
_UNITTEST_311 = re.compile(r"^(\S+) \((\S+)\.\1\)$")
COMPAT_DIR = "/tmp/opd/compat"
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
    """What grading one patch found. ``status`` is pass / fail / error (error: the harness could not grade)."""

    status: str
    reason: str
    log_path: str = ""
    metrics: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)


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


def eval_script(row: Mapping, spec: Mapping) -> str:
    """The bash script run in the container: apply the model patch and the test patch, run the instance's tests."""
    test_files = upstream.modified_files(row["test_patch"])
    test_cmd = " ".join([spec["test_cmd"], *upstream.test_directives(row)])
    reset = f"git checkout -q HEAD -- {' '.join(test_files)} 2>/dev/null || true" if test_files else ":"
    lines = [
        "set -uo pipefail",
        f"cd {TESTBED}",
        "export HOME=/tmp",
        "git config --global --add safe.directory '*'",
        "if [ -s /tmp/opd/model.patch ]; then",
        "  if git apply -v /tmp/opd/model.patch; then :;",
        "  elif patch --batch --fuzz=5 -p1 -i /tmp/opd/model.patch; then :;",
        f"  else echo '{APPLY_FAILED}'; exit 3; fi",
        "fi",
        f"echo '{APPLIED}'",
        *eval_commands(spec),
        *([f"export PYTHONPATH={COMPAT_DIR}${{PYTHONPATH:+:$PYTHONPATH}}"] if recorded_before_311(spec) else []),
        reset,
        f"git apply -v /tmp/opd/test.patch || {{ echo '{TEST_PATCH_FAILED}'; exit 4; }}",
        f"echo '{START}'",
        f"{test_cmd} 2>&1",
        f"echo '{END}'",
    ]
    return "\n".join(lines) + "\n"


def stdin_bundle(files: Mapping[str, str]) -> bytes:
    """A tar of ``{name: text}``, given to the container on stdin and unpacked into ``/tmp/opd``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_section(log: str) -> str | None:
    """The test command's output between the markers (None when the tests never started or never ended)."""
    start = log.find(START)
    if start < 0:
        return None
    end = log.find(END, start)
    return log[start + len(START) : end if end >= 0 else len(log)]


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
    summary = f"FAIL_TO_PASS {len(f2p.get('success', []))}/{len(row['FAIL_TO_PASS'])}, PASS_TO_PASS {len(p2p.get('success', []))}/{len(row['PASS_TO_PASS'])}"
    return ("pass" if verdict == "RESOLVED_FULL" else "fail"), f"{verdict}: {summary}", report


def patch_key(patch: str) -> str:
    return hashlib.sha256(patch.encode()).hexdigest()[:12]


def grade_patch(row: Mapping, patch: str, image: str, log_dir: Path, *, timeout_s: float = 1800.0, memory_mb: int = 4096, cpus: float = 2.0) -> Outcome:
    """Grade ``patch`` on instance ``row`` in a fresh container of ``image``; the log goes to ``log_dir/<id>/<patch hash>.log``.

    Never raises for what the patch or the tests do; an infrastructure failure (Docker, image, harness timeout)
    is status ``error``."""
    import sandbox

    log_path = Path(log_dir) / row["instance_id"] / f"{patch_key(patch)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    empty = not patch.strip()
    metrics = {"empty_patch": float(empty)}
    try:
        spec = upstream.spec_of(row["repo"], row["version"])
        script = eval_script(row, spec)
    except (KeyError, upstream.SwebenchMissing) as exc:
        log_path.write_text(f"cannot grade: {exc}\n")
        return Outcome("error", str(exc), str(log_path), metrics)
    files = {"model.patch": patch if patch.endswith("\n") or empty else patch + "\n", "test.patch": row["test_patch"], "eval.sh": script}
    bundle = stdin_bundle(files | {"compat/sitecustomize.py": OLD_SHORT_DESCRIPTION})
    started = time.perf_counter()
    sb = sandbox.open_sandbox("docker", image=image, tmpfs_mb=1024, http_timeout_s=timeout_s + 120, retries=1)
    try:
        try:
            session = sb.session(memory_mb=memory_mb, cpus=cpus, pids=1024, network=False)
        except sandbox.SandboxUnavailable as exc:
            log_path.write_text(f"sandbox unavailable: {exc}\n")
            return Outcome("error", f"sandbox unavailable: {exc}", str(log_path), metrics)
        with session:
            request = sandbox.ExecRequest(
                argv=["bash", "-c", "mkdir -p /tmp/opd && tar -x -C /tmp/opd && exec bash /tmp/opd/eval.sh"],
                stdin=bundle, timeout_s=timeout_s, memory_mb=memory_mb, cpus=cpus, pids=1024, max_output_bytes=32 << 20,
            )
            result = session.run(request)
    finally:
        sb.close()
    log = result.stdout + ("\n--- stderr ---\n" + result.stderr if result.stderr else "")
    metrics["container_s"] = time.perf_counter() - started  # this grading container, from start to log
    log_path.write_text(f"# image {image}\n# status {result.status} exit {result.exit_code} ({result.duration_s:.1f}s)\n{log}", encoding="utf-8")
    if result.status == "error":
        return Outcome("error", f"sandbox error: {result.error}", str(log_path), metrics)
    if result.status in ("timeout", "oom", "killed") and START not in log:
        return Outcome("error", f"grading {result.status} before the tests ran ({result.error or ''})", str(log_path), metrics)
    if APPLY_FAILED in log:
        metrics["patch_applied"] = 0.0
        return Outcome("fail", "the patch does not apply (git apply and patch --fuzz=5 both failed)", str(log_path), metrics)
    metrics["patch_applied"] = float(APPLIED in log and not empty)
    if TEST_PATCH_FAILED in log:
        return Outcome("error", "the instance's test patch does not apply", str(log_path), metrics)
    if result.status == "timeout":
        return Outcome("error", f"the tests ran past {timeout_s:g}s", str(log_path), metrics)
    status, reason, report = decide(row, log)
    return Outcome(status, reason, str(log_path), metrics, report)
