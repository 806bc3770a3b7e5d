"""Progress output in logs: periodic lines, never carriage-return redraws."""

from __future__ import annotations

import io

from harness.progress import LogProgress


def test_log_progress_writes_lines_not_redraws(monkeypatch):
    clock = iter(range(0, 1000, 10))  # each monotonic() call advances 10 s
    monkeypatch.setattr("harness.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = LogProgress(range(6), desc="train", every_s=25.0, file=out)
    for i in bar:
        bar.set_postfix(loss=f"{i / 10:.1f}")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 1 < len(lines) < 6  # a line now and then, not one per step
    assert lines[-1].startswith("train: 6/6 after ") and lines[-1].endswith("(loss=0.5)")


def test_progress_in_a_non_terminal_is_a_log_line(capsys):
    from harness.progress import progress

    for _ in progress(range(3), desc="SFT teacher", total=3):
        pass
    err = capsys.readouterr().err
    assert "\r" not in err and err.strip().startswith("SFT teacher: 3/3 after")
