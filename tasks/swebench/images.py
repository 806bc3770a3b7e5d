"""One Docker image per SWE-bench instance, built offline from the sandbox's Debian base (never ``docker pull``).

An instance image is ``opd-sandbox:bookworm`` plus:
  - ``/opt/venv``: a Python 3.11 venv with the instance's pinned requirements (the ``pip:`` pins of its
    ``environment.yml``; without one, the spec's requirements file read from the repository tree), installed
    ``--no-deps`` as the frozen environment they are. A pin that cannot be installed on 3.11 (no wheel, no
    build) is dropped and recorded; ``python``, ``pip`` and the venv's scripts come first on the default PATH
    (``/usr/local/bin`` wrappers), so the sandbox's fixed PATH finds them, and a ``.pth`` gives the base interpreter
    the venv's packages (tox-current-env runs the tests through a link to the interpreter, which is no venv);
  - the repository at ``base_commit`` in ``/box`` (the sandbox's work root, writable in every container) with
    ``/testbed`` a link to it: the spec's ``pre_install`` and ``install`` steps run (editable install), then the
    tree is one git commit, owned by the sandbox user.
The build runs in a throw-away container (root, network on, the host's CA bundle mounted and given to pip) and
is committed as ``opd-swebench:<instance>-<hash>``; the hash covers every input (base image, pins, repository
tarball, spec steps, this builder), so a changed input gives a new tag and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opd_harness.sandbox.build import DEFAULT_TAG as BASE_IMAGE

BUILDER_VERSION = "2"
IMAGE_REPO = "opd-swebench"
VENV = "/opt/venv"
REPO_DIR = "/box"  # the docker sandbox's work root: its anonymous volume starts as a copy of this directory
TESTBED = "/testbed"  # SWE-bench's path, a link to REPO_DIR
BOOTSTRAP_PIP = "pip==24.2"  # bootstraps the venv (Debian's python3 has no ensurepip); 24.2 still runs legacy setup.py develop
BUILD_TOOLS = ("setuptools==69.5.1", "wheel==0.43.0")
LABEL = "opd-harness.swebench"
DEFAULT_CA = "/etc/ssl/certs/ca-certificates.crt"


class ImageBuildError(RuntimeError):
    """The Docker daemon, a build step or the commit failed; the message says which and where the log is."""


@dataclass(frozen=True)
class BuildInputs:
    """Everything an instance image is made from (its hash is the image tag's suffix)."""

    instance_id: str
    repo: str
    version: str
    tarball: str  # path of the tree at base_commit (tar, optionally xz/gz)
    tarball_sha256: str
    pins: tuple[str, ...]  # requirement lines installed --no-deps
    pre_install: tuple[str, ...]
    install: str
    base_image_id: str

    def key(self) -> str:
        data = asdict(self) | {"builder": BUILDER_VERSION, "tools": [BOOTSTRAP_PIP, *BUILD_TOOLS]}
        data.pop("tarball")  # its content is in tarball_sha256
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def tag(self) -> str:
        return image_tag(self.instance_id, self.key())


@dataclass
class BuildResult:
    tag: str
    built: bool
    seconds: float
    dropped: dict[str, str] = field(default_factory=dict)  # pin -> why it was dropped
    log: str = ""


def image_tag(instance_id: str, key: str) -> str:
    """``opd-swebench:<instance id, lower case>-<key>``."""
    return f"{IMAGE_REPO}:{re.sub(r'[^a-z0-9_.-]', '-', instance_id.lower())}-{key}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def environment_pins(text: str) -> list[str]:
    """The ``pip:`` requirement lines of a conda ``environment.yml`` (exact pins in SWE-bench's frozen files)."""
    import yaml

    doc = yaml.safe_load(text) or {}
    for dep in doc.get("dependencies") or []:
        if isinstance(dep, dict) and "pip" in dep:
            return [str(p).strip() for p in dep["pip"] or [] if str(p).strip()]
    return []


def requirement_lines(text: str) -> list[str]:
    """Requirement lines of a requirements file, without comments, options and the project itself."""
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith(("#", "-", ".")):
            out.append(line)
    return out


def requirement_name(line: str) -> str:
    """The normalised project name of a requirement line (``Jinja2==2.11`` -> ``jinja2``)."""
    name = re.split(r"[\s<>=!~;\[@]", line.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


# pip's messages that name the requirement it failed on
_CULPRITS = (
    re.compile(r"No matching distribution found for ([^\s]+)"),
    re.compile(r"Failed building wheel for ([^\s]+)"),
    re.compile(r"Failed to build (?:installable wheels for some pyproject.toml based projects )?\(?([^\s)]+)"),
    re.compile(r"requires a different Python: .*\n?.*?([A-Za-z0-9_.-]+==\S+)"),
)


def failed_requirements(pip_output: str, pins: list[str]) -> list[str]:
    """The pins a failed ``pip install --no-deps -r`` run could not install, read from its output; when pip names
    none, the last one it was collecting (pip collects in order and stops at the first failure)."""
    by_name = {requirement_name(p): p for p in pins}
    named = {requirement_name(m) for rx in _CULPRITS for m in rx.findall(pip_output)} & set(by_name)
    if named:
        return [by_name[n] for n in named]
    collecting = [requirement_name(m) for m in re.findall(r"^Collecting (\S+)", pip_output, flags=re.M)]
    last = next((n for n in reversed(collecting) if n in by_name), None)
    return [by_name[last]] if last else []


def _docker(*args: str, timeout: float = 3600, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, timeout=timeout, input=stdin)


def image_exists(tag: str) -> bool:
    """Whether ``tag`` is on the daemon. Raises ImageBuildError when the daemon does not answer."""
    try:
        info = _docker("version", "--format", "{{.Server.Version}}", timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageBuildError(f"docker CLI failed: {exc}") from exc
    if info.returncode != 0:
        raise ImageBuildError(f"Docker daemon unreachable: {info.stderr.decode(errors='replace').strip()[-300:]}")
    return _docker("image", "inspect", tag, timeout=30).returncode == 0


def base_image_id(tag: str = BASE_IMAGE) -> str:
    """The id of the sandbox base image; ImageBuildError saying how to build it when it is missing."""
    if not image_exists(tag):
        raise ImageBuildError(f"base image {tag!r} not found; build it with `harness sandbox build`")
    return _docker("image", "inspect", "--format", "{{.Id}}", tag, timeout=30).stdout.decode().strip()


def image_labels(tag: str) -> dict[str, str]:
    proc = _docker("image", "inspect", "--format", "{{json .Config.Labels}}", tag, timeout=30)
    return json.loads(proc.stdout or b"{}") or {} if proc.returncode == 0 else {}


def dropped_of(tag: str) -> dict[str, str]:
    """The pins left out of an existing image (recorded in its labels)."""
    return json.loads(image_labels(tag).get(f"{LABEL}.dropped", "{}"))


def bootstrap_wheel(cache_dir: Path) -> Path:
    """A pip wheel to bootstrap the venv with (downloaded once by the host's pip into ``cache_dir/wheels``)."""
    import sys

    wheels = cache_dir / "wheels"
    found = sorted(wheels.glob(f"pip-{BOOTSTRAP_PIP.split('==')[1]}-*.whl"))
    if found:
        return found[-1]
    wheels.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), BOOTSTRAP_PIP],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = sorted(wheels.glob("pip-*.whl"))
    if proc.returncode != 0 or not found:
        raise ImageBuildError(f"could not download {BOOTSTRAP_PIP} to bootstrap the venv: {proc.stderr[-500:]}")
    return found[-1]


class _Builder:
    """A running build container and the log of what ran in it."""

    def __init__(self, inputs: BuildInputs, cache_dir: Path, log_path: Path, ca_bundle: str | None) -> None:
        self.inputs, self.cache_dir, self.log_path = inputs, cache_dir, log_path
        self.name = f"opd-swebench-build-{uuid.uuid4().hex[:12]}"
        self.ca_bundle = ca_bundle
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def start(self, need_pip: bool) -> None:
        pip_cache = self.cache_dir / "pip-cache"
        pip_cache.mkdir(parents=True, exist_ok=True)
        mounts = ["-v", f"{Path(self.inputs.tarball).resolve()}:/run/opd/repo.tar:ro", "-v", f"{pip_cache.resolve()}:/run/opd/pip-cache"]
        env = {
            "PIP_CACHE_DIR": "/run/opd/pip-cache",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "PIP_ROOT_USER_ACTION": "ignore",
            "HOME": "/root",
        }
        if need_pip:
            wheel = bootstrap_wheel(self.cache_dir)
            mounts += ["-v", f"{wheel.resolve()}:/run/opd/{wheel.name}:ro"]
            self.wheel = f"/run/opd/{wheel.name}"
        if self.ca_bundle and Path(self.ca_bundle).is_file():
            mounts += ["-v", f"{Path(self.ca_bundle).resolve()}:/run/opd/ca.crt:ro"]
            env["PIP_CERT"] = "/run/opd/ca.crt"
        for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
            if os.environ.get(var, "").startswith("http"):
                env[var] = os.environ[var]
        envs = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        # the sandbox's ownership labels: a build container left by a crashed process is reaped like any sandbox container
        from opd_harness.sandbox.docker import LABEL as SANDBOX_LABEL, OWNER, OWNER_LABEL

        labels = ["--label", f"{SANDBOX_LABEL}=1", "--label", f"{OWNER_LABEL}={OWNER}"]
        proc = _docker(
            "run",
            "-d",
            "--name",
            self.name,
            *labels,
            "--user",
            "0:0",
            "--workdir",
            "/",
            *mounts,
            *envs,
            BASE_IMAGE,
            "sleep",
            "infinity",
            timeout=300,
        )
        if proc.returncode != 0:
            raise ImageBuildError(f"could not start the build container: {proc.stderr.decode(errors='replace')[-1000:]}")

    def sh(self, script: str, what: str, check: bool = True, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        """Run ``script`` with bash in the build container; its output goes to the log."""
        started = time.perf_counter()
        self.log.write(f"\n### {what}\n$ {script}\n")
        self.log.flush()
        args = [
            "exec",
            *(["-i"] if stdin is not None else []),
            self.name,
            "bash",
            "-c",
            f"set -eo pipefail; export PATH={VENV}/bin:$PATH; {script}",
        ]
        proc = _docker(*args, stdin=stdin)
        out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
        self.log.write(out + f"\n### exit {proc.returncode} after {time.perf_counter() - started:.1f}s\n")
        self.log.flush()
        if check and proc.returncode != 0:
            raise ImageBuildError(f"{self.inputs.instance_id}: {what} failed (exit {proc.returncode}); log: {self.log_path}\n{out[-1500:]}")
        return proc

    def close(self) -> None:
        _docker("rm", "-f", "-v", self.name, timeout=120)
        self.log.close()


def _failures_file(cache_dir: Path, base_id: str) -> Path:
    return cache_dir / f"dropped-pins-{base_id.split(':')[-1][:12]}.json"


def known_failures(cache_dir: Path, base_id: str) -> dict[str, str]:
    """Pins an earlier build on the same base image found uninstallable (``cache_dir/dropped-pins-<base>.json``): pin -> why."""
    path = _failures_file(cache_dir, base_id)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def remember_failures(cache_dir: Path, base_id: str, dropped: dict[str, str]) -> None:
    """Record dropped pins so that later builds on the same base image skip them at once."""
    path = _failures_file(cache_dir, base_id)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(known_failures(cache_dir, base_id) | dropped, indent=1, sort_keys=True))
    tmp.replace(path)


def install_pins(builder: _Builder, pins: list[str]) -> dict[str, str]:
    """``pip install --no-deps`` the pins; drop the ones pip cannot install here and retry. Returns {dropped pin: why}.
    Pins already known to fail here (:func:`known_failures`) are dropped without trying them again."""
    base = builder.inputs.base_image_id
    known = known_failures(builder.cache_dir, base)
    dropped: dict[str, str] = {p: known[p] for p in pins if p in known}
    todo = [p for p in pins if p not in dropped]
    while todo:
        proc = builder.sh("pip install --no-deps -r /dev/stdin", f"install {len(todo)} pins", check=False, stdin="\n".join(todo).encode())
        if proc.returncode == 0:
            break
        out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
        culprits = failed_requirements(out, todo)
        if not culprits:
            raise ImageBuildError(
                f"{builder.inputs.instance_id}: pip failed and named no requirement; log: {builder.log_path}\n{out[-1500:]}"
            )
        for pin in culprits:
            reason = (
                "no release for this Python"
                if re.search(rf"(No matching distribution|different Python).*{re.escape(pin.split('==')[0])}", out, re.I)
                else "could not be built"
            )
            dropped[pin] = reason
            todo.remove(pin)
        remember_failures(builder.cache_dir, base, {p: dropped[p] for p in culprits})
    return dropped


def build_instance_image(inputs: BuildInputs, cache_dir: Path, *, force: bool = False, ca_bundle: str | None = None) -> BuildResult:
    """Build (or reuse) the instance image for ``inputs``; the build log is kept under ``cache_dir/build-logs``.

    Raises:
        ImageBuildError: the daemon, a build step or the commit failed.
    """
    tag = inputs.tag
    started = time.perf_counter()
    if image_exists(tag) and not force:
        return BuildResult(tag, False, 0.0, dropped_of(tag))
    logs = cache_dir / "build-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{tag.split(':', 1)[1]}.log"
    ca = ca_bundle if ca_bundle is not None else os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or DEFAULT_CA
    need_pip = bool(inputs.pins or inputs.install)
    builder = _Builder(inputs, cache_dir, log_path, ca)
    try:
        builder.start(need_pip)
        builder.sh(f"python3 -m venv --without-pip {VENV}", "create the venv")
        if need_pip:
            builder.sh(
                f"python {builder.wheel}/pip install -q --no-index {builder.wheel} && pip install -q {' '.join(BUILD_TOOLS)}",
                "bootstrap pip",
            )
        tree = (
            f"mkdir -p {REPO_DIR} && cd {REPO_DIR} && python3 -c \"import tarfile; tarfile.open('/run/opd/repo.tar').extractall('.')\""
            f" && ln -sfn {REPO_DIR} {TESTBED}"
        )
        builder.sh(tree, "extract the repository")
        dropped = install_pins(builder, list(inputs.pins)) if inputs.pins else {}
        for step in inputs.pre_install:
            builder.sh(f"cd {TESTBED} && {step}", "pre_install")
        if inputs.install:
            builder.sh(f"cd {TESTBED} && {inputs.install}", "install")
        commit = (
            f"cd {REPO_DIR} && git config --global --add safe.directory '*' && git init -q && git add -A"
            " && git -c user.name=SWE-bench -c user.email=setup@swebench.config commit -q --no-verify -m base && chown -R 65534:65534 ."
        )
        builder.sh(commit, "commit the tree")
        wrappers = (
            f"for f in {VENV}/bin/*; do n=$(basename $f); case $n in activate*|python*) ;; *) ln -sfn $f /usr/local/bin/$n;; esac; done;"
            f" for n in python python3 python3.11; do printf '#!/bin/sh\\nexec {VENV}/bin/python \"$@\"\\n' > /usr/local/bin/$n;"
            " chmod 755 /usr/local/bin/$n; done"
        )
        builder.sh(wrappers, "put the venv first on PATH")
        # A link to the interpreter elsewhere (tox-current-env's .tox/<env>/bin/python) is not the venv: give the base
        # interpreter the venv's packages too (appended after its own, which hold only the base image's python3-numpy).
        site = f"{VENV}/lib/python3.11/site-packages"
        builder.sh(
            f"echo 'import site; site.addsitedir(\"{site}\")' > /usr/local/lib/python3.11/dist-packages/opd-swebench-venv.pth",
            "venv packages for linked interpreters",
        )
        labels = {
            f"{LABEL}": "1",
            f"{LABEL}.instance": inputs.instance_id,
            f"{LABEL}.key": inputs.key(),
            f"{LABEL}.dropped": json.dumps(dropped, sort_keys=True),
        }
        changes = [f"WORKDIR {REPO_DIR}", f"ENV PATH=/usr/local/sbin:/usr/local/bin:{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        changes += [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]
        proc = _docker("commit", *(a for c in changes for a in ("--change", c)), builder.name, tag, timeout=1800)
        if proc.returncode != 0:
            raise ImageBuildError(f"docker commit failed: {proc.stderr.decode(errors='replace')[-1000:]}")
        builder.log.write(f"\n### committed {tag}; dropped pins: {json.dumps(dropped)}\n")
    except subprocess.TimeoutExpired as exc:
        raise ImageBuildError(f"{inputs.instance_id}: a build step timed out ({exc.timeout:.0f}s); log: {log_path}") from exc
    finally:
        builder.close()
    return BuildResult(tag, True, time.perf_counter() - started, dropped, str(log_path))
