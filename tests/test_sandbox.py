"""Sandbox providers (docker and local): streams, limits, statuses, sessions, the warm pool, reaping.

Docker tests are marked ``docker``. Without a daemon (or without the image) they skip with the
reason, unless ``HARNESS_REQUIRE_DOCKER=1`` (set by CI), where they fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from opd_harness import sandbox
from opd_harness.sandbox import ExecRequest, ExecResult
from opd_harness.sandbox.docker.provider import DEFAULT_SESSION_POOL

from conftest import SANDBOX_IMAGE as IMAGE  # noqa: E402
from conftest import docker_unavailable as _unavailable  # noqa: E402


from conftest import sandbox_request as py  # noqa: E402


# ---------------------------------------------------------------- API and registry (no Docker)


def test_registry_and_validation():
    assert {"docker", "local"} <= set(sandbox.provider_names())
    with pytest.raises(KeyError, match="valid: docker, local"):
        sandbox.open_sandbox("dockr")
    with pytest.raises(KeyError, match="duplicate"):
        sandbox.register_provider("local")(type("Other", (sandbox.Sandbox,), {}))
    with pytest.raises(ValueError):
        ExecRequest(argv="python3 -c 1")
    with pytest.raises(ValueError):
        ExecRequest(argv=["true"], timeout_s=0)
    with pytest.raises(ValueError, match="leaves"):
        sandbox.resolve_path("/box", "/box", "../etc/passwd")
    assert sandbox.resolve_path("/box", "/box/a", "b/../c.txt") == "/box/a/c.txt"
    assert ExecResult.failed("x").status == "error" and not ExecResult.failed("x").success


def test_sandbox_imports_nothing_else_of_the_project():
    code = (
        "import sys; from opd_harness import sandbox; "
        "import opd_harness.sandbox.local, opd_harness.sandbox.docker, opd_harness.sandbox.build; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'harness', 'tasks', 'trainers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_docker_daemon_unavailable_is_error_after_bounded_retries():
    try:
        import docker  # noqa: F401 - only the SDK is needed, not a daemon
    except ImportError:
        _unavailable("the docker SDK is not installed (pip install docker==7.2.0)")
    with sandbox.open_sandbox("docker", base_url="unix:///nonexistent/docker.sock", retries=2, retry_delay_s=0.01, reap=False) as sb:
        r = sb.run(ExecRequest(argv=["true"]))
        assert r.status == "error" and r.attempts == 3 and not r.success
        assert "unreachable" in r.error or "failed" in r.error
        with pytest.raises(sandbox.SandboxUnavailable):
            sb.session()


# ---------------------------------------------------------------- both providers


def test_streams_exit_code_and_env(sb, monkeypatch):
    monkeypatch.setenv("OPD_HOST_SECRET", "hunter2")  # must not leak into the sandbox
    code = (
        "import os, sys; print('out'); print('err', file=sys.stderr); "
        "print(os.environ.get('OPD_HOST_SECRET'), os.environ['MINE']); sys.exit(3)"
    )
    r = sb.run(py(sb, code, env={"MINE": "yes", "IFS": "x"}))
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 3, "out\nNone yes\n", "err\n")
    assert not r.stdout_truncated and not r.stderr_truncated and r.duration_s > 0


def test_files_in_stdin_and_cwd(sb):
    files = {"main.py": b"import sys\nprint(open('data/in.txt').read().strip(), sys.stdin.read().upper())", "data/in.txt": b"hello"}
    r = sb.run(ExecRequest(argv=[sb.python, "main.py"], files=files, stdin=b"world"))
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "hello WORLD\n"), r
    r = sb.run(ExecRequest(argv=["sh", "-c", "pwd; ls -A"], files={"x": b"1"}, cwd="sub"))
    assert r.stdout.splitlines()[0].endswith("/box/sub") and r.stdout.splitlines()[1:] == ["x"], r  # the stdin file is gone


def test_large_inputs(sb):
    blob = os.urandom(1_500_000)  # over the docker provider's argv budget: sent by put_archive
    code = "import hashlib, sys; print(hashlib.sha256(open('blob', 'rb').read()).hexdigest(), len(sys.stdin.buffer.read()))"
    r = sb.run(py(sb, code, files={"blob": blob}, stdin=b"s" * 3_000_000))
    import hashlib

    assert (r.status, r.stdout) == ("ok", f"{hashlib.sha256(blob).hexdigest()} 3000000\n"), r


def test_session_persists_files_and_cwd(sb):
    with sb.session() as s:
        s.write_files({"proj/a.txt": b"A"})
        s.chdir("proj")
        r1 = s.run(ExecRequest(argv=["sh", "-c", "pwd; cat a.txt; echo B > b.txt"]))
        r2 = s.run(ExecRequest(argv=["sh", "-c", "pwd; ls"]))
        assert s.cwd == "/box/proj"
        assert r1.stdout.splitlines()[0] == r2.stdout.splitlines()[0] and r1.stdout.splitlines()[0].endswith("/box/proj")
        assert r1.stdout.splitlines()[1] == "A" and r2.stdout.splitlines()[1:] == ["a.txt", "b.txt"]
        assert s.read_file("b.txt") == b"B\n" and s.read_file("/box/proj/a.txt") == b"A"
        with pytest.raises(FileNotFoundError):
            s.read_file("missing.txt")
        with pytest.raises(ValueError):
            s.read_file("../../etc/passwd")
        with pytest.raises(FileNotFoundError):
            s.chdir("nowhere")
        assert s.run(ExecRequest(argv=["sleep", "30"], timeout_s=0.5)).status == "timeout"
        assert s.run(ExecRequest(argv=["cat", "a.txt"])).stdout == "A"  # still usable after a timeout


# ---------------------------------------------------------------- docker only


@pytest.mark.docker
def test_docker_locked_down(docker_sb):
    code = (
        "import os\n"
        "for p in ('/etc/x', '/usr/x'):\n"
        "    try:\n        open(p, 'w')\n    except OSError as e:\n        print(e.strerror)\n"
        "open('/box/ok', 'w').write('1'); open('/tmp/ok', 'w').write('1')\n"
        "print(os.getuid(), os.getgid())\n"
        "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])\n"
    )
    r = docker_sb.run(py(docker_sb, code))
    assert r.stdout.splitlines() == ["Read-only file system", "Read-only file system", "65534 65534", "0000000000000000"], r


@pytest.mark.docker
def test_docker_pool_reuses_and_cleans(docker_client):
    with sandbox.open_sandbox("docker", image=IMAGE, pool_size=1) as sb:
        dirty = (
            "mkdir -p /box/d && touch /box/d/f /box/.hidden '/box/a b' '/box/-x*' /tmp/t /dev/shm/s && chmod 000 /box/d && "
            "(setsid sleep 300 > /dev/null 2>&1 &) && echo done"
        )
        assert sb.run(ExecRequest(argv=["sh", "-c", dirty])).stdout == "done\n"
        code = (
            "import os\n"
            "print(os.listdir('/box'), os.listdir('/tmp'), os.listdir('/dev/shm'))\n"
            "print(sorted(open(f'/proc/{p}/comm').read().strip() for p in os.listdir('/proc') if p.isdigit()))"
        )
        r = sb.run(py(sb, code))
        assert r.stdout.splitlines() == ["[] [] []", "['python3', 'python3']"], r  # exec server (PID 1), program: no sleep
        shm = "import ctypes\nprint(ctypes.CDLL(None).shmget(0x4242, 4096, 0o1600) >= 0)"  # IPC_CREAT | 0600
        assert sb.run(py(sb, shm)).stdout == "True\n"
        assert sb.run(py(sb, "print(len(open('/proc/sysvipc/shm').read().splitlines()) - 1)")).stdout == "0\n"  # removed
        assert sb.stats["created"] == 1 and sb.stats["reused"] == 3 and sb.stats["discarded"] == 0


@pytest.mark.docker
def test_docker_exec_server_ignores_the_programs_signals(docker_client):
    """The pooled container's exec server is PID 1: a program's kill -9 -1, SIGKILL or SIGSTOP to it change nothing."""
    code = ("import os, signal; print('bye', flush=True)\n"
            "for target, sig in ((-1, signal.SIGKILL), (1, signal.SIGKILL), (1, signal.SIGSTOP), (1, signal.SIGINT)):\n"
            "    try:\n        os.kill(target, sig)\n    except ProcessLookupError:\n        pass  # kill(-1) finds nobody else\n"
            "print('still here')")  # fmt: skip
    with sandbox.open_sandbox("docker", image=IMAGE, pool_size=1) as sb:
        r = sb.run(py(sb, code))
        assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "bye\nstill here\n"), r
        assert sb.run(ExecRequest(argv=["echo", "next"], timeout_s=5)).stdout == "next\n"
        assert sb.stats["created"] == 1 and sb.stats["discarded"] == 0, sb.stats


@pytest.mark.docker
def test_docker_parallel_runs_bounded_by_pool(docker_client):
    code = "import time; t = time.time(); time.sleep(0.6); print(t, time.time())"
    with sandbox.open_sandbox("docker", image=IMAGE, pool_size=2) as sb:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(sb.run, [py(sb, code)] * 6))
        wall = time.perf_counter() - t0
        assert all(r.status == "ok" for r in results), results
        spans = [tuple(map(float, r.stdout.split())) for r in results]
        peak = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
        assert peak <= 2 and wall >= 3 * 0.6 and sb.stats["created"] == 2 and sb.stats["reused"] == 4, (peak, wall, sb.stats)


@pytest.mark.docker
def test_docker_reaps_leftovers_of_dead_owners(docker_client):
    from opd_harness.sandbox.docker import LABEL, OWNER, OWNER_LABEL, reap_leftovers

    dead = subprocess.Popen(["true"])
    dead.wait()
    labels_dead = {LABEL: "1", OWNER_LABEL: f"{socket.gethostname()}:{dead.pid}:0"}
    labels_live = {LABEL: "1", OWNER_LABEL: OWNER}
    c_dead = docker_client.containers.create(IMAGE, ["true"], labels=labels_dead, network_disabled=True)
    c_live = docker_client.containers.create(IMAGE, ["true"], labels=labels_live, network_disabled=True)
    try:
        reap_leftovers(docker_client)
        ids = {c["Id"] for c in docker_client.api.containers(all=True, filters={"label": f"{LABEL}=1"})}
        assert c_dead.id not in ids and c_live.id in ids
    finally:
        for c in (c_dead, c_live):
            try:
                c.remove(force=True)
            except Exception:  # noqa: BLE001
                pass


@pytest.mark.docker
def test_docker_crashed_run_is_reaped_by_the_next_process(docker_client):
    from opd_harness.sandbox.docker import LABEL, OWNER_LABEL

    crash = (
        f"import os; from opd_harness import sandbox; sb = sandbox.open_sandbox('docker', image={IMAGE!r}, prewarm=1); "
        "print(os.getpid(), sb.stats['created'], flush=True); os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True)
    pid, created = proc.stdout.split()
    assert proc.returncode == -9 and created == "1", proc.stderr

    def owned_by(pid: str) -> list:
        found = docker_client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
        return [c for c in found if c["Labels"][OWNER_LABEL].split(":")[1] == pid]

    assert len(owned_by(pid)) <= 1  # (another process starting now may have reaped it already)
    # The next process reaps it when it first connects, and removes its own containers at exit
    # (it never calls close()).
    nxt = (
        f"import os; from opd_harness import sandbox; sb = sandbox.open_sandbox('docker', image={IMAGE!r}); s = sb.session(); "
        "print(os.getpid(), sb.run(sandbox.ExecRequest(argv=['true'])).status)"
    )
    nxt_pid, status = subprocess.run([sys.executable, "-c", nxt], capture_output=True, text=True).stdout.split()
    assert status == "ok"
    assert owned_by(pid) == [] and owned_by(nxt_pid) == []


@pytest.mark.docker
def test_docker_close_removes_containers_and_missing_image_is_error(docker_client):
    from opd_harness.sandbox.docker import OWNER, OWNER_LABEL

    def ours() -> set[str]:
        return {c.id for c in docker_client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={OWNER}"})}

    before = ours()
    sb = sandbox.open_sandbox("docker", image=IMAGE, pool_size=2, prewarm=2)
    s = sb.session()
    mine = ours() - before
    assert len(mine) == 3 and s.container_id in mine
    sb.close()
    assert not ours() & mine
    with sandbox.open_sandbox("docker", image="opd-sandbox:does-not-exist", retries=3) as bad:
        r = bad.run(ExecRequest(argv=["true"]))
        assert r.status == "error" and r.attempts == 1 and "opd_harness.sandbox.build" in r.error


@pytest.mark.docker
def test_docker_outer_guard_kills_container(docker_client, monkeypatch):
    import opd_harness.sandbox.docker.provider as sd

    # Simulate a broken in-container timeout: only the outer guard (timeout_s + grace_s) is left.
    broken = sd._SERVER.replace("            kill_group(pid)\n", "            pass\n")
    assert broken != sd._SERVER
    monkeypatch.setattr(sd, "_SERVER", broken)
    with sandbox.open_sandbox("docker", image=IMAGE, pool_size=1, grace_s=0.5) as sb:
        t0 = time.perf_counter()
        r = sb.run(ExecRequest(argv=["sleep", "30"], timeout_s=1.0))
        assert r.status == "timeout" and time.perf_counter() - t0 < 1.0 + 0.5 + 2.0, r
        assert sb.stats["discarded"] == 1
        assert sb.run(ExecRequest(argv=["echo", "ok"])).stdout == "ok\n"


# ---------------------------------------------------------------- local only


def test_local_reports_network_isolation_and_runs_unprivileged(local_sb):
    assert isinstance(local_sb.network_isolated, bool)
    r = local_sb.run(py(local_sb, "import os; print(os.getuid() != 0); open('/root/x', 'w')"))
    if os.geteuid() == 0:
        assert r.stdout == "True\n" and "Permission denied" in r.stderr, r
    token = f"opd-escape-{os.getpid()}-{time.time_ns()}"
    escaped = f"import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)  # {token}\nprint('parent done')"
    r = local_sb.run(py(local_sb, escaped))
    assert r.status == "ok" and r.stdout == "parent done\n", r
    # Killed after the run even though it left the process group (PID namespace / per-run uid).
    if local_sb.pid_isolated or local_sb.root_mode:
        assert _live_with(token) == []


def _live_with(token: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmd and state not in ("Z", "X"):
            found.append(int(pid))
    return found


def test_local_parallel_threads(local_sb):
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(local_sb.run, [ExecRequest(argv=["echo", str(i)]) for i in range(8)]))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


@pytest.mark.skipif(os.geteuid() != 0, reason="per-session uids are taken only when started as root")
def test_a_uid_given_back_clean_is_not_scanned_but_one_a_crashed_holder_left_is(local_sb, monkeypatch):
    """Taking a uid looks through /proc for its processes (hundreds of sessions make that the cost of opening one) only
    when its last holder did not give it back empty: a holder that crashed leaves its processes to the next one."""
    from opd_harness.sandbox import local

    uid = local_sb._take_uid()
    monkeypatch.setattr(local_sb, "_uid_range", [uid])  # the next take gets this uid again
    monkeypatch.setattr(local_sb, "_uid_next", 0)
    leftover = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[], start_new_session=True)
    try:
        os.close(local_sb._uid_files.pop(uid))  # the holder crashes: its flock goes, its process stays
        assert local_sb._take_uid() == uid
        assert leftover.wait(timeout=10) == -9  # the take killed it
        local_sb._give_uid(uid)  # nothing left: given back clean
        scans = []
        real = local._kill_uid
        monkeypatch.setattr(local, "_kill_uid", lambda u, *a: scans.append(u) or real(u, *a))
        assert local_sb._take_uid() == uid and scans == []  # not looked for
        local_sb._give_uid(uid)
        assert scans == ([] if local_sb.pid_isolated else [uid])  # no run went: in PID namespaces nothing to look for
    finally:
        leftover.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="per-session uids are taken only when started as root")
def test_a_uid_whose_runs_ended_on_their_own_is_given_back_without_a_scan_but_not_after_a_timeout(local_sb, monkeypatch):
    """In PID namespaces a run that ended on its own left nothing (the kernel reaps its namespace before ``unshare``
    returns, even a daemon that left the group), so giving its uid back needs no look through /proc; after a run that
    was killed at its timeout, or with one still going, it does."""
    from opd_harness.sandbox import local

    if not local_sb.pid_isolated:
        pytest.skip("no PID namespaces here: every give scans")
    token = f"opd-quiet-{os.getpid()}-{time.time_ns()}"
    daemon = f"import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)  # {token}\nprint('done')"
    s = local_sb.session()  # taking may scan (a uid a crashed holder left): counted from here on
    scans = []
    real = local._kill_uid
    monkeypatch.setattr(local, "_kill_uid", lambda u, *a: scans.append(u) or real(u, *a))
    assert s.run(py(local_sb, daemon)).stdout == "done\n" and s.run(ExecRequest(argv=["true"])).success
    uid = s._uid
    s.close()
    assert scans == [] and _live_with(token) == []  # no scan, and the daemon is gone all the same
    fd = os.open(local._UID_LOCK_DIR / str(uid), os.O_RDONLY)
    try:
        assert os.read(fd, 16) == local._CLEAN  # the next holder skips its scan too
    finally:
        os.close(fd)
    s = local_sb.session()
    assert s.run(ExecRequest(argv=["sleep", "30"], timeout_s=0.5)).status == "timeout"
    scans.clear()
    s.close()
    assert s._uid in scans  # killed at its timeout: the give looks


@pytest.mark.skipif(os.geteuid() != 0, reason="per-session uids are taken only when started as root")
def test_a_uid_with_no_lock_file_yet_is_taken_without_a_scan(local_sb, monkeypatch, tmp_path):
    """A uid never taken since the lock directory was made (at boot, under /run) has no process to look for: a fresh
    machine's first 4096 sessions would otherwise each scan /proc. One whose file exists but is not marked clean is."""
    from opd_harness.sandbox import local

    monkeypatch.setattr(local, "_UID_LOCK_DIR", tmp_path / "locks")
    scans = []
    monkeypatch.setattr(local, "_kill_uid", lambda u, *a: scans.append(u) or True)
    uid = local_sb._take_uid()
    assert scans == [] and (tmp_path / "locks" / str(uid)).exists()
    os.close(local_sb._uid_files.pop(uid))  # the holder crashes: the file stays, unmarked
    monkeypatch.setattr(local_sb, "_uid_range", [uid])
    monkeypatch.setattr(local_sb, "_uid_next", 0)
    assert local_sb._take_uid() == uid and scans == [uid]
    local_sb._give_uid(uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="per-session uids are taken only when started as root")
def test_local_sandbox_has_uids_for_two_256_episode_rollouts_at_once(local_sb, monkeypatch):
    """A rollout of 256 tool episodes holds 256 interpreter sessions, each under its own uid; two runs side by side (two
    workers of a sweep) need over 512 at once. Each uid is also taken from the machine-wide lock directory."""
    monkeypatch.setattr("opd_harness.sandbox.local._kill_uid", lambda uid: None)  # nothing runs under them here
    taken = []
    try:
        for _ in range(2 * 256 + 64):
            taken.append(local_sb._take_uid())
        assert len(set(taken)) == len(taken) and all(uid > 60000 for uid in taken)  # above Debian's UID_MAX
    finally:
        for uid in taken:
            local_sb._give_uid(uid)



@pytest.mark.docker
def test_docker_served_session_runs_through_the_exec_server_and_is_removed_on_close(docker_client, monkeypatch):
    """A served session's runs are exec-server requests (no docker exec) that keep its files and background processes;
    closed, its container is removed, not reset for another session."""
    import docker

    with sandbox.open_sandbox("docker", image=IMAGE, pool_size=1) as sb:
        s = sb.session(served=True)
        execs, create = [], sb.client().api.exec_create
        monkeypatch.setattr(sb.client().api, "exec_create", lambda *a, **k: execs.append(a) or create(*a, **k))
        assert s.run(ExecRequest(argv=["sh", "-c", "touch kept && (setsid sleep 300 > /dev/null 2>&1 &)"])).success
        r = s.run(ExecRequest(argv=["sh", "-c", "ls; grep -l '^sleep' /proc/[0-9]*/comm | wc -l"]))
        assert r.stdout.split() == ["kept", "1"] and execs == [], r
        first = s.container_id
        s.close()
        assert not sb._idle_sessions.get(s._box.limits) and sb.stats["sessions_discarded"] == 0
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(first)


@pytest.mark.docker
def test_docker_pooled_session_keeps_state_between_runs_and_is_reset_or_removed_on_close(docker_client):
    """A pooled session's runs keep its files and background processes; closed, its container is reset and handed to
    the next pooled session; closed while a run is in flight, it is removed instead (the run fails)."""
    import threading

    import docker

    with sandbox.open_sandbox("docker", image=IMAGE, pool_size=1) as sb:
        s = sb.session(pooled=True)
        assert s.run(ExecRequest(argv=["sh", "-c", "touch kept && (setsid sleep 300 > /dev/null 2>&1 &)"])).success
        r = s.run(ExecRequest(argv=["sh", "-c", "ls; grep -l '^sleep' /proc/[0-9]*/comm | wc -l"]))
        assert r.stdout.split() == ["kept", "1"], r
        first = s.container_id
        s.close()
        s = sb.session(pooled=True)
        assert s.container_id == first and sb.stats["sessions_reused"] == 1
        r = s.run(ExecRequest(argv=["sh", "-c", "ls -A /box /tmp; grep -l '^sleep' /proc/[0-9]*/comm | wc -l"]))
        assert r.stdout.split() == ["/box:", "/tmp:", "0"], r
        results = []
        t = threading.Thread(target=lambda: results.append(s.run(ExecRequest(argv=["sleep", "30"], timeout_s=40))))
        t.start()
        time.sleep(1.0)
        s.close()
        t.join(timeout=20)
        assert results and results[0].status in ("killed", "error"), results
        assert not sb._idle_sessions.get(s._box.limits)
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(first)


@pytest.mark.docker
def test_docker_idle_session_pool_follows_the_most_pooled_sessions_open_at_once(docker_client):
    """By default (``session_pool`` None) every session of a round with more open at once than the 16 kept at least goes
    back to the pool on close, so the next round of as many creates no container (a rollout step's episodes hold
    their sessions across turns: all of a step are open at once)."""
    n = DEFAULT_SESSION_POOL + 2
    with sandbox.open_sandbox("docker", image=IMAGE) as sb, ThreadPoolExecutor(6) as pool:
        for round_ in range(2):
            sessions = list(pool.map(lambda _: sb.session(memory_mb=128, pooled=True), range(n)))
            created = sb.stats["created"]
            list(pool.map(lambda s: s.close(), sessions))
            assert sb.stats["sessions_discarded"] == 0 and len(sb._idle_sessions[sessions[0]._box.limits]) == n
            assert sb.idle_session_cap() == n
        assert created == n and sb.stats["sessions_reused"] == n  # the second round took the first round's containers


@pytest.mark.docker
def test_docker_prewarmed_sessions_are_handed_out_by_pooled_sessions_of_their_limits(docker_client):
    """``prewarm_sessions`` starts idle session containers (at most ``session_pool``) that pooled sessions with the same
    limits take instead of starting their own; other limits and unpooled sessions start new containers."""
    with sandbox.open_sandbox("docker", image=IMAGE, session_pool=2) as sb:
        assert sb.prewarm_sessions(3, memory_mb=256, disk_mb=16) == 2  # capped at session_pool
        assert sb.prewarm_sessions(1, memory_mb=256, disk_mb=16) == 0  # already full
        warm = {b.container.id for b in sb._idle_sessions[next(iter(sb._idle_sessions))]}
        sessions = [sb.session(memory_mb=256, disk_mb=16, pooled=True) for _ in range(2)]
        assert {s.container_id for s in sessions} == warm and sb.stats["sessions_reused"] == 2
        assert all(s.run(ExecRequest(argv=["sh", "-c", "ls -A /box; echo ran"])).stdout == "ran\n" for s in sessions)
        other = sb.session(memory_mb=256, pooled=True)  # no disk limit: not one of the prewarmed
        assert other.container_id not in warm and sb.stats["sessions_reused"] == 2
        for s in [*sessions, other]:
            s.close()
