"""Untrusted code stays contained (issue 4): fork bomb, memory hog, infinite loop, sleeping past the
timeout, network, writes outside the work directory, host files and environment, enormous output,
signals to other processes. Each case runs on both providers where it applies and checks the
status the harness reports and that the harness process and the sandbox are unharmed afterwards.
"""

import os
import sys
import time

import pytest

from conftest import sandbox_request as py
from opd_harness.sandbox import ExecRequest


def test_program_signalling_everything_is_contained(sb):
    r = sb.run(py(sb, "import os, signal; print('bye', flush=True); os.kill(-1, signal.SIGKILL)"))
    assert r.status in ("killed", "ok") and r.stdout.startswith("bye"), r  # the harness (this process) is alive
    assert sb.run(ExecRequest(argv=["echo", "next"])).stdout == "next\n"


def test_output_caps(sb):
    r = sb.run(py(sb, "import sys; sys.stdout.write('x' * 3_000_000); sys.stderr.write('e' * 10)", max_output_bytes=1000))
    assert r.status == "ok" and r.stdout == "x" * 1000 and r.stdout_truncated
    assert r.stderr == "e" * 10 and not r.stderr_truncated


def test_file_size_cap(sb):
    r = sb.run(py(sb, "open('big', 'wb').write(b'x' * (65 << 20))"))  # default cap 64 MiB; Python ignores SIGXFSZ
    assert r.exit_code != 0 and "File too large" in r.stderr, r


def test_infinite_loop_times_out(sb):
    t0 = time.perf_counter()
    r = sb.run(py(sb, "while True: pass", timeout_s=1.0))
    assert r.status == "timeout" and time.perf_counter() - t0 < 1.0 + 2.0, r
    # What was printed before the timeout is kept. 3 s, not 0.5: the interpreter must start and print first, and on
    # Python 3.13 at load ~30 (two training workers beside the leg; it failed alone and beside the other legs) its
    # start-up alone took over 0.5 s.
    r = sb.run(py(sb, "import time; print('start', flush=True); time.sleep(30)", timeout_s=3.0))
    assert r.status == "timeout" and r.stdout == "start\n", r


def test_memory_hog_is_oom(sb, request):
    if sys.version_info >= (3, 13) and sb.name == "local":
        # CPython 3.13.5 (Debian trixie) itself sometimes hangs printing the MemoryError traceback once RLIMIT_AS is hit
        # (stderr ends at "Traceback (most recent call last):"): `prlimit --as=134217728 python3 -c <this hog>` hung in
        # 4 of 30 runs there, 3.11 in 0 of 30; the run then ends as `timeout`, not `oom`. Not strict: it passes when
        # the interpreter does not hang.
        request.applymarker(pytest.mark.xfail(reason="CPython 3.13 can hang printing a MemoryError under RLIMIT_AS", strict=False))
    r = sb.run(py(sb, "x = []\nwhile True: x.append(bytearray(16 << 20))", memory_mb=128, timeout_s=10))
    assert r.status == "oom", r


def test_signal_is_killed(sb):
    r = sb.run(py(sb, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    assert (r.status, r.exit_code) == ("killed", 128 + 11), r


def test_process_limit_and_fork_bomb(sb):
    count = (
        "import os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
    )
    r = sb.run(py(sb, count, pids=16, timeout_s=5))
    assert r.status == "ok" and 0 < int(r.stdout) < 16, r
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    t0 = time.perf_counter()
    r = sb.run(py(sb, bomb, pids=32, timeout_s=1.5))
    assert r.status == "timeout" and time.perf_counter() - t0 < 1.5 + 3.0, r
    assert sb.run(ExecRequest(argv=["echo", "fine"])).stdout == "fine\n"  # the sandbox recovered


def test_network_unreachable(sb):
    if getattr(sb, "network_isolated", True) is False:
        pytest.skip("this machine gives the local provider no network namespace")
    code = (
        "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=3)\n"
        "    print('connected')\nexcept OSError as e:\n    print(e.errno)"
    )
    r = sb.run(py(sb, code))
    assert r.status == "ok" and r.stdout.strip() == "101", r  # ENETUNREACH: no interface but lo
    r = sb.run(py(sb, "import socket; print(socket.if_nameindex())"))
    assert "'lo'" in r.stdout and "eth" not in r.stdout


def test_writing_outside_the_work_directory_is_denied(sb):
    targets = ["/etc/opd-pwned", "/usr/opd-pwned", os.path.join(os.getcwd(), "opd-pwned")]
    code = (
        "import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'w').write('x')\n"
        "        print('wrote', p)\n    except OSError:\n        print('denied', p)"
    )
    r = sb.run(ExecRequest(argv=[sb.python, "-c", code, *targets]))
    assert r.status == "ok" and "wrote" not in r.stdout and r.stdout.count("denied") == 3, r
    assert not any(os.path.exists(p) for p in targets)  # nothing appeared on the host


def test_host_files_and_environment_are_invisible(sb, tmp_path, monkeypatch):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("s3cret-file")
    monkeypatch.setenv("OPD_HOST_SECRET", "s3cret-env")
    code = ("import os, sys\ntry:\n    print(open(sys.argv[1]).read())\nexcept OSError as e:\n    print('unreadable', type(e).__name__)\n"
            "print(os.environ.get('OPD_HOST_SECRET'))\nprint(any('s3cret' in v for v in os.environ.values()))")  # fmt: skip
    r = sb.run(ExecRequest(argv=[sb.python, "-c", code, str(secret)]))
    assert r.status == "ok" and "s3cret" not in r.stdout and r.stdout.splitlines()[1:] == ["None", "False"], r
    assert r.stdout.startswith("unreadable")


def test_sleeping_past_the_timeout_is_a_timeout(sb):
    t0 = time.perf_counter()
    r = sb.run(py(sb, "import time; time.sleep(60)", timeout_s=1.0))
    assert r.status == "timeout" and time.perf_counter() - t0 < 1.0 + 3.0, r
    assert sb.run(ExecRequest(argv=["echo", "next"])).stdout == "next\n"


def test_signals_cannot_reach_the_harness(sb):
    me = os.getpid()
    code = (
        f"import os, signal\ntry:\n    os.kill({me}, signal.SIGKILL)\n"
        "    print('sent')\nexcept OSError as e:\n    print('refused', e.errno)"
    )
    r = sb.run(py(sb, code))
    assert r.status == "ok", r
    assert os.getpid() == me  # we are still running: Docker has no such pid, and locally another uid may not signal us
