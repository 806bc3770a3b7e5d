"""Shared fixtures: tiny models built locally (no hub), quiet libraries."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session", autouse=True)
def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def char_tokenizer():
    from opd_harness.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(char_tokenizer):
    from opd_harness.models.tiny import TinyArch, build_tiny_model

    def make(seed: int = 0, hidden: int = 32, layers: int = 1):
        arch = TinyArch(hidden=hidden, layers=layers, heads=2, kv_heads=1, ffn=2 * hidden)
        return build_tiny_model(
            arch, len(char_tokenizer), pad_id=char_tokenizer.pad_token_id, eos_id=char_tokenizer.eos_token_id, seed=seed
        )

    return make


REQUIRE_DOCKER = os.environ.get("HARNESS_REQUIRE_DOCKER") == "1"  # CI sets it: Docker tests fail instead of skipping
SANDBOX_IMAGE = os.environ.get("HARNESS_SANDBOX_IMAGE", "opd-sandbox:bookworm")


def docker_unavailable(reason: str):
    """Skip with the reason, or fail loudly where Docker is required (CI)."""
    if REQUIRE_DOCKER:
        pytest.fail(f"HARNESS_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_client():
    """A live Docker client with the sandbox image present."""
    try:
        import docker
    except ImportError:
        docker_unavailable("the docker SDK is not installed (pip install docker==7.2.0)")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001
        docker_unavailable(f"no Docker daemon ({type(exc).__name__}: {exc}); start it with `dockerd &`")
    try:
        client.images.get(SANDBOX_IMAGE)
    except docker.errors.ImageNotFound:
        docker_unavailable(f"image {SANDBOX_IMAGE} missing; build it with `python -m opd_harness.sandbox.build`")
    return client


@pytest.fixture(scope="module")
def docker_sb(docker_client):
    """A Docker sandbox (pool of 2) for the tests of one module."""
    from opd_harness import sandbox

    with sandbox.open_sandbox("docker", image=SANDBOX_IMAGE, pool_size=2) as sb:
        yield sb


@pytest.fixture(scope="module")
def local_sb():
    """A local-provider sandbox for the tests of one module."""
    from opd_harness import sandbox

    with sandbox.open_sandbox("local", network_isolation="auto") as sb:
        yield sb


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def sb(request):
    """Each test once per provider (Docker ones marked `docker`)."""
    return request.getfixturevalue(f"{request.param}_sb")


REQUIRE_DATA = os.environ.get("HARNESS_REQUIRE_DATA") == "1"  # CI sets it: tests fail when benchmark files are missing
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"  # a checkout beside the project's data folder


def benchmark_data_dir() -> Path:
    """Where tests read benchmark files: ``$HARNESS_DATA_DIR``, else ``../shared/data`` beside the repository."""
    return Path(os.environ.get("HARNESS_DATA_DIR") or DEFAULT_DATA_DIR).expanduser()


def missing_data_reason(missing: list[str], folder: Path, env_value: str | None) -> str:
    """Why a test skips: the files missing, where ``HARNESS_DATA_DIR`` points (the folder ``--data-dir`` takes) and the
    command that fetches them; never the fallback folder beside the checkout, which only this project's machines have."""
    tasks = " ".join(sorted({name.split("/")[0] for name in missing}))
    where = f"in HARNESS_DATA_DIR={folder}" if env_value else "(HARNESS_DATA_DIR is not set)"
    target = folder if env_value else "DIR"
    then = "" if env_value else ", then set HARNESS_DATA_DIR=DIR (the folder harness run/eval --data-dir DIR reads)"
    return f"benchmark data missing {where}: {', '.join(missing)}; fetch with `harness data fetch {tasks} --to {target}`{then}"


def data_unavailable(reason: str):
    """Skip with the reason, or fail loudly where benchmark data is required (CI)."""
    if REQUIRE_DATA:
        pytest.fail(f"HARNESS_REQUIRE_DATA=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def benchmark_data() -> Callable[..., Path]:
    """``benchmark_data("math500/test.jsonl", ...)``: the data folder once every named file is in it.

    A missing file skips the test with the path and the command that fetches it (fails under
    ``HARNESS_REQUIRE_DATA=1``). The folder is read once per session, so tests that set
    ``HARNESS_DATA_DIR`` for the code under test do not move it.
    """
    folder = benchmark_data_dir()

    def need(*files: str) -> Path:
        missing = [name for name in files if not (folder / name).is_file()]
        if missing:
            data_unavailable(missing_data_reason(missing, folder, os.environ.get("HARNESS_DATA_DIR")))
        return folder

    return need


def sandbox_request(sb, code: str, **kw):
    """An ExecRequest running ``code`` with the sandbox's Python."""
    from opd_harness.sandbox import ExecRequest

    return ExecRequest(argv=[sb.python, "-c", code], **kw)


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster on this machine (``node_a``, ``node_b`` custom resources, 2 CPUs each), shared by the
    session's tests and stopped by its own process ids; asserts that no process of it is left behind."""
    pytest.importorskip("ray")
    from ray_cluster import remove_cluster_dir, start_two_node_cluster

    cluster = start_two_node_cluster()
    yield cluster
    left = cluster.stop()
    remove_cluster_dir(cluster)
    assert not left, f"processes of the test cluster still alive: {left}"


def pytest_collection_modifyitems(items):
    """Mark ``ray`` (a test in a test_ray_* module or using a Ray fixture: ray_cluster, local_ray, ...) and ``browser``
    (the headless Chromium fixture), so that ``-m "not docker and not ray and not browser"`` selects the tests that need
    none of those services (the newer-Python CI leg, .ci/legs/newer_python.sh)."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.path.name.startswith("test_ray_") or any("ray" in name.split("_") for name in fixtures):
            item.add_marker(pytest.mark.ray)
        if "chromium" in fixtures:
            item.add_marker(pytest.mark.browser)
