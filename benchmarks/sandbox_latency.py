"""Sandbox latency and throughput: a cold container per run vs the warm pool, and the local provider.

Same trivial program in every mode, measured side by side in one run; prints medians and the
cold/warm ratio. Needs a running Docker daemon and the `opd-sandbox:bookworm` image.
Usage: ``python benchmarks/sandbox_latency.py [--runs 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from opd_harness import sandbox
from opd_harness.sandbox import ExecRequest

PROGRAM = ExecRequest(argv=["python3", "main.py"], files={"main.py": b"print(sum(range(1000)))"})


def timed_runs(run, n: int) -> list[float]:
    """Wall seconds of ``n`` sequential calls of ``run()`` (each must succeed)."""
    out = []
    for _ in range(n):
        started = time.perf_counter()
        result = run()
        assert result.success, result
        out.append(time.perf_counter() - started)
    return out


def cold_run():
    """Open a provider, run once in a fresh container, remove it: the cost without a pool."""
    with sandbox.open_sandbox("docker", pool_size=1, reap=False) as sb:
        return sb.run(PROGRAM)


def throughput(sb, request: ExecRequest, jobs: int, threads: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(sb.run, [request] * jobs))
    assert all(r.success for r in results)
    return jobs / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    cold = timed_runs(cold_run, max(args.runs // 2, 3))
    with sandbox.open_sandbox("docker", pool_size=4, prewarm=4, reap=False) as sb:
        sb.run(PROGRAM)
        warm = timed_runs(lambda: sb.run(PROGRAM), args.runs)
        pooled_rate = throughput(sb, ExecRequest(argv=["python3", "-c", "pass"]), 40, 8)
    with sandbox.open_sandbox("local") as sb:
        local_program = ExecRequest(argv=[sb.python, "main.py"], files=PROGRAM.files)
        local = timed_runs(lambda: sb.run(local_program), args.runs)
        local_rate = throughput(sb, ExecRequest(argv=[sb.python, "-c", "pass"]), 40, 4)
    cold_ms, warm_ms, local_ms = (statistics.median(x) * 1e3 for x in (cold, warm, local))
    print(
        f"docker cold container per run: median {cold_ms:.0f} ms; warm pool: median {warm_ms:.0f} ms; "
        f"ratio cold/warm {cold_ms / warm_ms:.1f}x"
    )
    print(
        f"docker pool of 4, 8 threads: {pooled_rate:.1f} runs/s; "
        f"local provider: median {local_ms:.0f} ms, 4 threads {local_rate:.1f} runs/s"
    )


if __name__ == "__main__":
    main()
