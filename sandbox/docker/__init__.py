"""Docker provider: every program runs in a locked-down container from a locally built image.

Each container (``DockerSandbox`` options in brackets):
  - image ``opd-sandbox:bookworm`` [``image``], built by ``python -m opd_harness.sandbox.build`` (never pulled);
  - no network (``network_mode=none``; only ``lo`` exists) unless a request sets ``network=True``;
  - read-only root file system; a writable anonymous volume at ``/box`` (the work root, removed
    with the container) and a tmpfs at ``/tmp`` [``tmpfs_mb``, default 64]; ``/dev/shm`` is
    Docker's (64 MiB). ``/box`` lives on the daemon's disk with no total quota, except in a session
    opened with ``disk_mb``: there it is a tmpfs-backed volume of that size (a write past it fails
    with ENOSPC; tmpfs pages count against the container's memory limit). Each file written is
    capped at ``max_file_mb`` [64] (RLIMIT_FSIZE: the write fails with EFBIG, or SIGXFSZ kills the
    program: status ``killed``);
  - user 65534:65534, all capabilities dropped, ``no-new-privileges``;
  - cgroup limits from the request: memory (swap off), CPU quota, pids (every process and thread
    in the container, including the sandbox's own: the exec server (PID 1), and in a session's run
    the wrapper and `timeout`);
  - labels ``opd-harness.sandbox=1`` and ``opd-harness.sandbox.owner=<host>:<pid>:<start time>``:
    containers whose owner process is gone (a crashed run) are removed when the next process first
    connects, and every container of this process is removed by ``close()`` (idle, busy and session
    containers alike) or, for a sandbox never closed, at exit (``atexit``: open sandboxes are held by
    strong references until closed, so one dropped without ``close()`` is still cleaned up).
  - ``check_ready()`` says, before any run, whether the daemon answers and the image exists
    (``SandboxUnavailable`` naming the command that fixes it).

Runs:
  - The timeout is enforced inside the container (the program's process group is killed with
    SIGKILL) and by an outer wall-clock guard at ``timeout_s + grace_s`` [``grace_s``, 2] that
    kills the whole container.
  - ``oom`` is read from the container's cgroup OOM-kill counter when the host exposes it,
    otherwise from exit status 137 before the timeout.
  - Each Docker API round trip costs ~50-100 ms, so every container's PID 1 is an exec server
    (``exec_server.py``; non-dumpable, so programs can neither read its memory nor write into its
    reply stream; as PID 1 it gets no signal from them but SIGCHLD) and a pooled run is one request
    on its attach stream (opened once per container): inputs and the program's output travel there.
    A session's run is one ``docker exec`` of a shell wrapper (inputs under 768 KiB travel in its
    argv; larger ones by ``put_archive``), except in a pooled session (below).
  - A warm pool holds at most ``pool_size`` [4] containers and runs at most ``pool_size`` programs
    at once (``run`` blocks for a free slot; safe from many threads). After each run every process
    of the sandbox user is killed, ``/box``, ``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` are
    emptied and every System V IPC object is removed; a container that cannot be cleaned, hit the
    outer guard, or failed is thrown away.
    A program cannot kill the exec server (``kill -1`` spares PID 1); should it die anyway (the OOM
    killer), the run is ``killed`` and the container thrown away. ``prewarm`` [0] containers are
    started when the sandbox opens.
  - Infrastructure failures (daemon unreachable, create/exec errors) are retried ``retries`` [2]
    times with a growing delay [``retry_delay_s``, 0.5], then returned as status ``error``.
  - Sessions get their own container (not counted in the pool), removed by ``Session.close``; each
    run is a ``docker exec`` of a wrapper, or with ``session(served=True)`` a request to the
    container's exec server that skips the clean-up (as a pooled session's, below; the container
    is still removed on close).
    ``session(pooled=True)`` (the interpreter's) may take an idle container a closed pooled session
    left: its runs are requests to the exec server that skip the clean-up (files and background
    processes stay for the session's next run), ``Session.relay`` hands bytes to a socket a process
    of the session listens on with no process started, and ``close`` resets the container with the
    clean-up above (every process of the sandbox user killed; ``/box``, ``/tmp``, ``/dev/shm`` and
    ``/dev/mqueue`` emptied; System V IPC objects removed) and keeps it idle for the next (at most
    ``session_pool`` [None: the most pooled sessions open at once so far, at least 16]); one that cannot
    be cleaned, or is closed while a run is in flight, is removed.

Modules: ``provider`` (``DockerSandbox``: container creation and the warm pool), ``transport`` (a run through the
exec server or the session wrapper, the outer guard, the classification), ``frames`` (the exec server's wire format
and Docker's stream demultiplexing), ``session`` (``DockerSession``), ``cleanup`` (owner labels, reaping, closing at
exit), ``box`` (what they share of a container: work root, user, limits, input tars, OOM counter).
"""

from opd_harness.sandbox.docker.cleanup import LABEL, OWNER, OWNER_LABEL, reap_leftovers
from opd_harness.sandbox.docker.provider import DEFAULT_IMAGE, DockerSandbox, build_command
from opd_harness.sandbox.docker.session import DockerSession

__all__ = ["DEFAULT_IMAGE", "LABEL", "OWNER", "OWNER_LABEL", "DockerSandbox", "DockerSession", "build_command", "reap_leftovers"]
