"""The sweep's forked children (benchmarks/sweep/forked.py): output, exit status, timeout and crash rows."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from benchmarks.sweep.forked import ChildResult, run_forked


def _speak() -> None:
    print("SWEEP-ROW {}", flush=True)
    print("a warning", file=sys.stderr, flush=True)


def _raise() -> None:
    raise ValueError("boom in prepare")


def _sleep() -> None:
    time.sleep(30)


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_forked_child_hands_back_its_stdout_stderr_and_exit_code() -> None:
    assert run_forked(_speak, 30) == ChildResult(0, "SWEEP-ROW {}\n", "a warning\n")


def test_a_raising_child_exits_1_with_its_traceback_on_stderr() -> None:
    result = run_forked(_raise, 30)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.rstrip().endswith("ValueError: boom in prepare")


def test_a_child_past_its_timeout_is_killed_and_returns_none() -> None:
    started = time.monotonic()
    assert run_forked(_sleep, 1).returncode is None
    assert time.monotonic() - started < 10


def test_the_runner_writes_a_crash_row_for_a_child_killed_by_a_signal(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.sweep import forked
    from benchmarks.sweep import run as sweep_run

    monkeypatch.setattr(forked, "preload", lambda: None)  # the libraries are loaded in this process already
    monkeypatch.setattr(sweep_run, "_child", lambda *args: _killed())
    sweep_run.main(["--chunk", "0/100000", "--limit", "1", "--out", str(tmp_path)])
    (row,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert row["failed_stage"] == "crash"
    assert row["error"] == "Crash: killed by SIGKILL (the out-of-memory killer?)"
    assert row["wall"] < 60
