"""Build the Docker base image for the sandbox from Debian packages (never ``docker pull``).

The image is a Debian bookworm root filesystem made by ``mmdebstrap --variant=apt`` and loaded
with ``docker import``. The rootfs tarball is cached under ``cache_dir`` (git-ignored
``.cache/sandbox`` by default), keyed by suite and package list, so a rebuild after
``docker rmi`` takes seconds. Needs root (or a working user namespace) for mmdebstrap, network
access to the Debian mirror configured in ``/etc/apt``, and a running Docker daemon.

Usage: ``python -m opd_harness.sandbox.build [--force] [--tag opd-sandbox:bookworm]``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

DEFAULT_TAG = "opd-sandbox:bookworm"
SUITE = "bookworm"
# python3 (3.11) brings the whole standard library that HumanEval+/MBPP+/LiveCodeBench solutions
# import (math, itertools, collections, heapq, bisect, functools, re, typing, ...); numpy is the one
# third-party module they use; git and patch are for the later repository/tool-use environments.
DEFAULT_PACKAGES: tuple[str, ...] = ("python3", "python3-numpy", "git", "patch", "ca-certificates")
# Shrink the image: no docs, man pages or translations.
_DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
# The work directory must belong to the sandbox user: Docker copies its owner into the anonymous
# volume mounted there, and the image root is read-only at run time.
_HOOKS = (
    'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
    'mkdir -p "$1/box" && chown 65534:65534 "$1/box" && chmod 0755 "$1/box"',
)
_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1")
IMAGE_LABEL = "opd-harness.sandbox.image"


class BuildError(RuntimeError):
    """mmdebstrap, the Docker daemon or ``docker import`` failed; the message says which and why."""


def rootfs_key(packages: Sequence[str], suite: str = SUITE) -> str:
    """Cache key of a rootfs: a short hash of the suite, the sorted package list and the build options."""
    spec = "\n".join([suite, *sorted(set(packages)), *_DPKG_EXCLUDES, *_HOOKS])
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def build_rootfs(packages: Sequence[str] = DEFAULT_PACKAGES, cache_dir: Path = Path(".cache/sandbox"), force: bool = False) -> Path:
    """Create (or reuse) ``cache_dir/rootfs-<suite>-<key>.tar`` with mmdebstrap and return its path.

    Raises:
        BuildError: mmdebstrap is missing or failed.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tar = cache_dir / f"rootfs-{SUITE}-{rootfs_key(packages)}.tar"
    if tar.exists() and not force:
        return tar
    if shutil.which("mmdebstrap") is None:
        raise BuildError("mmdebstrap not found: apt-get install -y mmdebstrap")
    partial = tar.with_name(f"{tar.stem}.partial{os.getpid()}.tar")
    cmd = ["mmdebstrap", "--variant=apt", "--format=tar", "--quiet", f"--include={','.join(packages)}"]
    cmd += [f"--dpkgopt=path-exclude={p}" for p in _DPKG_EXCLUDES]
    cmd += [f"--customize-hook={h}" for h in _HOOKS]
    cmd += [SUITE, str(partial)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"mmdebstrap failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        partial.replace(tar)  # atomic: a half-written tarball is never taken for a cached one
    finally:
        partial.unlink(missing_ok=True)
    return tar


def _docker(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    if shutil.which("docker") is None:
        raise BuildError("the docker CLI is not installed: apt-get install -y docker.io")
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def image_id(tag: str = DEFAULT_TAG) -> str | None:
    """The id of image ``tag`` on the daemon, or None if there is none.

    Raises:
        BuildError: the docker CLI is missing or the daemon is unreachable.
    """
    info = _docker("version", "--format", "{{.Server.Version}}", timeout=30)
    if info.returncode != 0:
        raise BuildError(f"Docker daemon unreachable ({info.stderr.strip()[-300:]}); start it with `dockerd &`")
    proc = _docker("image", "inspect", "--format", "{{.Id}}", tag, timeout=30)
    return proc.stdout.strip() if proc.returncode == 0 else None


def build_base_image(
    tag: str = DEFAULT_TAG,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    cache_dir: Path = Path(".cache/sandbox"),
    force: bool = False,
) -> dict:
    """Build the sandbox base image: mmdebstrap rootfs (cached) + ``docker import`` as ``tag``.

    Idempotent: if ``tag`` exists already nothing is done, unless ``force`` (which also rebuilds
    the cached rootfs tarball). Uses the ``docker`` CLI, so it runs under any Python 3.11
    without the docker SDK (handy in CI before the venv exists).

    Returns:
        ``{"tag", "image_id", "built": bool, "rootfs": path or None, "seconds": {"rootfs", "import"}}``.
    Raises:
        BuildError: the daemon is unreachable, mmdebstrap failed, or the import failed.
    """
    existing = image_id(tag)
    if existing and not force:
        return {"tag": tag, "image_id": existing, "built": False, "rootfs": None, "seconds": {}}
    t0 = time.perf_counter()
    tar = build_rootfs(packages, cache_dir, force=force)
    t1 = time.perf_counter()
    changes = [f"ENV {e}" for e in _ENV]
    changes += [f"LABEL {IMAGE_LABEL}=1 {IMAGE_LABEL}.packages={','.join(packages)} {IMAGE_LABEL}.rootfs={tar.stem}", "WORKDIR /box"]
    proc = _docker("import", *(arg for c in changes for arg in ("--change", c)), str(tar), tag)
    new_id = image_id(tag)
    if proc.returncode != 0 or not new_id:
        raise BuildError(f"docker import of {tar} failed: {proc.stderr.strip()[-1000:]}")
    t2 = time.perf_counter()
    return {"tag": tag, "image_id": new_id, "built": True, "rootfs": str(tar), "seconds": {"rootfs": t1 - t0, "import": t2 - t1}}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse  # here: a task that names the image tag (`harness tasks`) does not load it

    parser = argparse.ArgumentParser(prog="python -m opd_harness.sandbox.build", description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"image tag (default {DEFAULT_TAG})")
    parser.add_argument("--force", action="store_true", help="rebuild the rootfs and re-import even if the image exists")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/sandbox"), help="where the rootfs tarball is cached")
    parser.add_argument("--package", action="append", dest="packages", help="Debian package to include (repeatable; replaces the defaults)")
    args = parser.parse_args(argv)
    try:
        info = build_base_image(args.tag, tuple(args.packages or DEFAULT_PACKAGES), args.cache_dir, force=args.force)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if info["built"]:
        s = info["seconds"]
        print(f"built {info['tag']} ({info['image_id'][:19]}) rootfs {s['rootfs']:.1f}s, import {s['import']:.1f}s, from {info['rootfs']}")
    else:
        print(f"{info['tag']} exists ({info['image_id'][:19]}); use --force to rebuild")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
