"""`harness leaderboard --format html`: one self-contained page (tables, plots, drill-down) merged from several
results roots, checked as text and in headless Chromium (tables and plots visible, sorting, a screenshot)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opd_harness.cli import app
from opd_harness.config import build_config
from opd_harness.store import SampleRow, Store

runner = CliRunner()

# ---- a results store with the shapes real runs write ------------------------------------------------


def _train_run(
    store: Store,
    run_id: str,
    *,
    method: str,
    mode: str,
    curve: list[float],
    samples_per_hour: float,
    fixed_lag: int | None = None,
    seed: int = 0,
) -> None:
    """A training run evaluated on arith every 100 steps, with per-step entropy / KL / lag and checkpoint counters."""
    overrides = [
        f"method={method}",
        f"trainer.mode={mode}",
        f"seed={seed}",
        *([f"trainer.fixed_lag={fixed_lag}"] if fixed_lag is not None else []),
        *(LAYOUT if method == "f_opd" else []),
    ]
    cfg = build_config(preset="smoke", overrides=overrides).model_dump()
    store.create_run(run_id, kind="train", config=cfg, method=method, task="arith")
    for i, avg in enumerate(curve):
        step = 100 * i
        summary = {
            "k": 4,
            "n_samples": 400,
            "n_problems": 100,
            "avg_at_k": avg,
            "ci_low": avg - 0.05,
            "ci_high": avg + 0.05,
            "n_errors": i % 2,
        }
        store.add_eval(run_id, step, "arith", summary, [], grader="math-verify", grader_version="0.9.0")
        if step:
            metrics = {"staleness_hist": {"0": 10 * step, "1": 3 * step if mode == "async" else 0},
                       "rollout_seconds": {"generate": 1.5 * step, "teacher": 0.2 * step},
                       "learner_seconds": {"train": 0.5 * step, "wait": 0.1 * step}, "refreshes": i,
                       "idle_ratio_rollout": 0.1, "idle_ratio_learner": 0.4,
                       "rollout_workers": [{"samples": 40 * step, "samples_per_s": 2.5, "idle_ratio": 0.25},
                                           {"samples": 24 * step, "samples_per_s": 1.5, "idle_ratio": 0.5}],
                       **({"placement": PLACEMENT} if method == "f_opd" else {})}  # fmt: skip
            store.add_checkpoint(
                run_id, step, path=None, samples_seen=int(samples_per_hour * step / 100), train_seconds=36.0 * step, metrics=metrics
            )
    for step in range(1, 100 * (len(curve) - 1) + 1, 10):
        store.log_step(
            run_id,
            step,
            {"student_entropy": 2.0 - step / 200, "teacher_kl": 1.0 / (1 + step / 50), "lag_mean": 0.5 if mode == "async" else 0.0},
        )
    (store.run_dir(run_id) / "method.json").write_text(json.dumps({"name": method, "description": f"{method} for the test",
                                                                     "hparams": {"kl_coef": 1.0}, "notes": {"kl_coef": "a note on kl_coef"},
                                                                     "warnings": []}))  # fmt: skip
    store.set_status(run_id, "done")


LAYOUT = ["trainer.executor=ray", "trainer.layout.rollout.replicas=2", "trainer.layout.rollout.strategy=spread",
          "trainer.layout.learner.num_gpus=1", "trainer.layout.eval.replicas=2", "trainer.layout.eval.max_sandboxes=1",
          "trainer.layout.eval.resources={node_b: 1}"]  # fmt: skip  (the f_opd run's)
PLACEMENT = {"rollout.0": "a" * 28, "rollout.1": "b" * 28, "teacher": "a" * 28, "learner": "b" * 28, "eval.0": "b" * 28, "eval.1": "b" * 28}


def _agentic_eval(store: Store, run_id: str) -> None:
    """An eval-only run of an agentic task: its summary carries episode measurements beyond Avg@k."""
    store.create_run(run_id, kind="eval", config={"model": "m"}, task="tools", model="/models/student")
    rows = [SampleRow(f"p{i}", 0, "c", None, float(i % 2), "pass" if i % 2 else "fail", 0.0, metrics={"tool_calls": i}) for i in range(4)]
    summary = {"k": 1, "n_samples": 4, "n_problems": 4, "avg_at_k": 0.5, "ci_low": 0.0, "ci_high": 1.0, "n_errors": 0, "n_pass": 2,
               "invalid_tool_rate": 0.25, "resolved": 0.5}  # fmt: skip
    store.add_eval(run_id, 0, "tools", summary, rows, grader="tool-judge", grader_version="2")
    store.set_status(run_id, "done")


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[Path, Path]:
    """Two results roots: (a) opd sync, f_opd async (collapses), a lag sweep and an agentic eval; (b) a run whose id clashes
    with one of (a)."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    with Store(a) as store:
        _train_run(store, "opd-sync", method="opd", mode="sync", curve=[0.2, 0.4, 0.5, 0.55], samples_per_hour=1000.0)
        _train_run(store, "fopd-async", method="f_opd", mode="async", curve=[0.2, 0.6, 0.3, 0.1], samples_per_hour=3000.0)
        _train_run(store, "lag0", method="opd", mode="async", curve=[0.2, 0.5], samples_per_hour=1500.0, fixed_lag=0)
        _train_run(store, "lag2", method="opd", mode="async", curve=[0.2, 0.3], samples_per_hour=1800.0, fixed_lag=2)
        _agentic_eval(store, "agent-eval")
        points = [{"run_id": r, "coords": {"trainer.fixed_lag": lag}} for r, lag in (("lag0", 0), ("lag2", 2))]
        (a / "sweeps").mkdir()
        (a / "sweeps" / "lag.json").write_text(json.dumps({"sweep_id": "lag", "grid_keys": ["trainer.fixed_lag"], "points": points}))
    with Store(b) as store:
        _train_run(store, "opd-sync", method="gkd", mode="sync", curve=[0.1, 0.3], samples_per_hour=500.0)
    return a, b


@pytest.fixture(scope="module")
def page(roots, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "board.html"
    result = runner.invoke(app, ["leaderboard", str(roots[0]), str(roots[1]), "--format", "html", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


class _Tables(HTMLParser):
    """Cell texts of every table by id (thead and tbody rows alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._stack: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._stack.append(dict(attrs).get("id", ""))
            self.tables.setdefault(self._stack[-1], [])
        elif tag == "tr" and self._stack:
            self.tables[self._stack[-1]].append([])
        elif tag in ("td", "th") and self._stack:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "table" and self._stack:
            self._stack.pop()
        elif tag in ("td", "th") and self._cell is not None and self._stack:
            self.tables[self._stack[-1]][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _table(html: str, table_id: str) -> list[dict[str, str]]:
    parser = _Tables()
    parser.feed(html)
    header, *rows = parser.tables[table_id]
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_page_is_self_contained(page):
    html = page.read_text()
    external = re.findall(r'(?:src|href)\s*=\s*"(?!#|data:)([^"]*)"', html)
    assert external == [], f"the page must open offline; it references {external}"
    assert "<link" not in html and "<script src" not in html and "@import" not in html
    assert html.count("<svg") >= 5  # Avg@k vs step for arith and tools, throughput vs accuracy, entropy/KL, staleness per run
    assert html.count('src="data:image/png;base64,') == 1  # the sweep's lag curve


def test_main_table_best_last_throughput_collapse_and_grader(page):
    rows = {(r["run"], r["task"]): r for r in _table(page.read_text(), "board")}
    opd, fopd = rows[("opd-sync", "arith")], rows[("fopd-async", "arith")]
    assert opd["best Avg@k [95% CI] @step"] == "0.550 [0.500, 0.600] @300" == opd["last Avg@k [95% CI] @step"]
    assert fopd["best Avg@k [95% CI] @step"] == "0.600 [0.550, 0.650] @100"
    assert fopd["last Avg@k [95% CI] @step"] == "0.100 [0.050, 0.150] @300"
    assert (opd["collapsed"], fopd["collapsed"]) == ("no", "yes")  # 0.1 < 0.5 x 0.6
    assert (opd["rel. throughput"], fopd["rel. throughput"]) == ("1.00", "3.00")  # ÷ the sync opd run with the same config
    assert (opd["samples/h"], fopd["mode"], fopd["grader"]) == ("1000", "async", "math-verify 0.9.0")


def test_agentic_task_metrics_become_columns(page):
    rows = {(r["run"], r["task"]): r for r in _table(page.read_text(), "board")}
    agent = rows[("agent-eval", "tools")]
    assert (agent["invalid_tool_rate"], agent["resolved"]) == ("0.250", "0.500")
    assert rows[("opd-sync", "arith")]["invalid_tool_rate"] == "-"  # a task without them
    assert "n_pass" not in agent  # the counts every evaluation has are not task metrics


def test_two_roots_merge_and_clashing_run_ids_stay_apart(page, roots):
    rows = _table(page.read_text(), "board")
    assert f"opd-sync ({roots[1]})" in {r["run"] for r in rows}
    summary = {(r["method"], r["mode"], r["task"]): r for r in _table(page.read_text(), "methods")}
    assert summary[("gkd", "sync", "arith")]["mean last Avg@k"] == "0.300"
    assert summary[("opd", "async", "arith")]["runs"] == "2" and summary[("f_opd", "async", "arith")]["collapse"] == "1/1"


def test_drill_down_has_config_method_checkpoints_staleness_and_timings(page):
    html = page.read_text()
    section = html[html.index('<details id="run-1">') :]
    section = section[: section.index("</details>")]
    assert "fopd-async" in section and "a note on kl_coef" in section and "&quot;trainer&quot;" in section
    checkpoints = _table(section, "run-1-checkpoints")
    assert [c["step"] for c in checkpoints] == ["0", "100", "200", "300"] and checkpoints[-1]["samples/h"] == "3000"
    window = [1.0 / (1 + s / 50) for s in range(101, 201, 10)]  # the steps logged after checkpoint 100, up to 200
    assert checkpoints[2]["teacher_kl"] == f"{sum(window) / len(window):.3f}" and checkpoints[0]["teacher_kl"] == "-"
    assert "staleness (to step 300)" in section and "<svg" in section and "generate" in section
    workers = section[section.index("<h4>rollout workers</h4>") :]
    assert '<td>1</td><td class="num" data-sort="7200">7200</td><td class="num" data-sort="1.5">1.5</td>' in workers
    layout = section[section.index("<h4>layout</h4>") : section.index("<h4>rollout workers</h4>")]
    a, b = "a" * 12, "b" * 12
    assert f"<tr><td>rollout</td><td>2</td><td>1 CPU</td><td>spread</td><td>{a}, {b}</td></tr>" in layout
    assert f"<tr><td>learner</td><td>1</td><td>1 CPU, 1 GPU</td><td>pack</td><td>{b}</td></tr>" in layout
    assert f"<tr><td>eval</td><td>2</td><td>1 CPU, 1 node_b; max 1 sandboxes per node</td><td>pack</td><td>{b}</td></tr>" in layout
    other = html[html.index('<details id="run-0">') :]
    assert "<h4>layout</h4>" not in other[: other.index("</details>")]  # an in-process run has no layout


def test_html_needs_out_and_a_store(roots, tmp_path):
    missing = runner.invoke(app, ["leaderboard", str(roots[0]), "--format", "html"])
    assert missing.exit_code == 2 and "--out" in missing.output
    absent = runner.invoke(
        app, ["leaderboard", str(roots[0]), str(tmp_path / "nope"), "--format", "html", "--out", str(tmp_path / "x.html")]
    )
    assert absent.exit_code == 2 and "no results store" in absent.output and not (tmp_path / "x.html").exists()
    bad = runner.invoke(app, ["leaderboard", str(roots[0]), "--format", "pdf"])
    assert bad.exit_code == 2 and "html" in bad.output


def test_text_formats_merge_roots_too(roots, tmp_path):
    result = runner.invoke(app, ["leaderboard", str(roots[0]), str(roots[1]), "--format", "csv", "--out", str(tmp_path / "b.csv")])
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "b.csv").read_text().splitlines()
    assert sum(",gkd," in line for line in lines) == 2 and sum(",f_opd," in line for line in lines) == 4


# ---- the page in headless Chromium (DevTools protocol over a pipe: no driver package needed) ---------

REQUIRE_BROWSER = os.environ.get("HARNESS_REQUIRE_BROWSER") == "1"  # .ci/run sets it: the browser test fails instead of skipping
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


class Chromium:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fd 3: commands in, fd 4: replies out, NUL-separated JSON)."""

    def __init__(self, binary: str, profile: Path) -> None:
        cmd_read, self._cmd = os.pipe()
        self._reply, reply_write = os.pipe()

        def wire_fds() -> None:  # in the child: our pipe ends become fds 3 and 4 (moved up first, as they may be 3 or 4 already)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_read, reply_write)]
            os.dup2(high[0], 3)  # dup2 onto another number clears close-on-exec
            os.dup2(high[1], 4)

        argv = [binary, *CHROMIUM_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1400,1000", "about:blank"]
        self.proc = subprocess.Popen(argv, preexec_fn=wire_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: PLW1509
        os.close(cmd_read)
        os.close(reply_write)
        self._next, self._buffer, self.events = 0, b"", []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._cmd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for reply in self._read(deadline):
                if reply.get("id") == self._next:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
                self.events.append(reply)

    def _read(self, deadline: float) -> list[dict]:
        ready, _, _ = select.select([self._reply], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError("Chromium did not answer in time")
        chunk = os.read(self._reply, 1 << 20)
        if not chunk:
            raise RuntimeError("Chromium closed the DevTools pipe")
        self._buffer += chunk
        *complete, self._buffer = self._buffer.split(b"\0")
        return [json.loads(m) for m in complete if m]

    def page(self, method: str, **params) -> dict:
        return self.call(method, session=self.session, **params)

    def js(self, expression: str):
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.page("Page.enable")
        self.page("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while not any(ev.get("method") == "Page.loadEventFired" for ev in self.events):
            self.events.extend(self._read(deadline))

    def click(self, selector: str) -> None:
        """A real mouse click at the middle of the element (pressed and released), not a synthetic JS click."""
        box = self.js(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)}); el.scrollIntoView({{block: 'center'}}); "
            "const r = el.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self) -> bytes:
        size = self.page("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": min(size["width"], 1400), "height": min(size["height"], 2400), "scale": 1}
        return base64.b64decode(self.page("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd)
        os.close(self._reply)


@pytest.fixture
def chromium(tmp_path):
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if binary is None:
        reason = "headless Chromium not installed (Debian: apt-get install chromium chromium-driver)"
        if REQUIRE_BROWSER:
            pytest.fail(f"HARNESS_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    browser = Chromium(binary, tmp_path / "profile")
    yield browser
    browser.close()


COLUMN = "Array.from(document.querySelectorAll('#board tbody tr')).map(r => r.cells[{col}].dataset.sort)"


def test_page_in_headless_chromium_tables_plots_sorting_and_screenshot(chromium, page, tmp_path):
    chromium.open(page.as_uri())
    visible = chromium.js(
        "(() => { const box = el => el.getBoundingClientRect(); const t = document.querySelector('#board');"
        " return {rows: t.tBodies[0].rows.length, table: [box(t).width, box(t).height],"
        " plots: Array.from(document.querySelectorAll('.plot svg, .plot img')).map(p => [box(p).width, box(p).height]),"
        " images_loaded: Array.from(document.querySelectorAll('.plot img')).every(i => i.complete && i.naturalWidth > 0)}; })()"
    )
    assert visible["rows"] == 6 and visible["table"][0] > 600 and visible["table"][1] > 100
    assert len(visible["plots"]) >= 5 and all(w > 150 and h > 100 for w, h in visible["plots"]), visible["plots"]
    assert visible["images_loaded"]

    headers = chromium.js("Array.from(document.querySelectorAll('#board th')).map(th => th.textContent)")
    col = headers.index("last Avg@k [95% CI] @step")
    chromium.click(f"#board th:nth-child({col + 1})")
    ascending = [float(v) for v in chromium.js(COLUMN.format(col=col))]
    assert ascending == sorted(ascending) and ascending[0] == pytest.approx(0.1)
    chromium.click(f"#board th:nth-child({col + 1})")
    descending = [float(v) for v in chromium.js(COLUMN.format(col=col))]
    assert descending == sorted(ascending, reverse=True)
    assert chromium.js(f"document.querySelector('#board th:nth-child({col + 1})').getAttribute('aria-sort')") == "descending"

    run_col = headers.index("run")
    chromium.click(f"#board th:nth-child({run_col + 1})")
    names = chromium.js(f"Array.from(document.querySelectorAll('#board tbody tr')).map(r => r.cells[{run_col}].textContent)")
    assert names == sorted(names, key=lambda s: s.lower()) or names == sorted(names)

    png = chromium.screenshot()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    (tmp_path / "leaderboard.png").write_bytes(png)
    if os.environ.get("HARNESS_SCREENSHOT_DIR"):
        Path(os.environ["HARNESS_SCREENSHOT_DIR"], "leaderboard.png").write_bytes(png)


def test_plots_have_readable_legends_axis_labels_and_no_lone_point(roots):
    """Legends at 10 px with short labels (an eval run by its model's name, not its run id), a y-axis label and a legend
    on both training-curve plots, no throughput scatter for one run, and the grader named once."""
    from opd_harness.leaderboard_page import grader_label, load_board, plot_avg_vs_step, plot_throughput_vs_accuracy, plot_training_curves

    board = load_board([roots[0]])
    curves = plot_training_curves(board)
    assert "student entropy (nats / token)" in curves and "reverse KL to teacher (nats / token)" in curves
    assert curves.count(">opd sync<") == 2 and curves.count(">f_opd async<") == 2  # one legend per plot
    tools = plot_avg_vs_step(board, "tools")
    assert ">eval student<" in tools and "agent-eval" not in tools
    legend_sizes = set(re.findall(r"font-size: (\d+)px", plot_avg_vs_step(board, "arith")))
    assert legend_sizes and min(int(size) for size in legend_sizes) >= 10, legend_sizes
    assert plot_throughput_vs_accuracy(load_board([roots[1]])) is None  # one run: no lone point on a 0.96-1.04 axis
    assert plot_throughput_vs_accuracy(board) is not None
    assert grader_label("math-verify", "math-verify==0.9.0") == "math-verify==0.9.0"
    assert grader_label("tool-judge", "2") == "tool-judge 2"
