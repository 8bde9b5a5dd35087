"""`bench/prompt_step_idle.py`: device busy and idle time between the reads of consecutive prompt steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_each_window_between_reads_gets_its_kernels_and_gaps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as `python bench/<script>.py` has it
    import prompt_step_idle

    mark = prompt_step_idle.READ_MARK
    events = [
        {"cat": "user_annotation", "name": mark, "ts": 0, "dur": 0},
        {"cat": "kernel", "name": "gemm", "ts": 1, "dur": 10},  # the first kernel: the trace starts with it
        {"cat": "kernel", "name": "norm", "ts": 5, "dur": 10},  # chained: 4 us its own
        {"cat": "user_annotation", "name": mark, "ts": 20, "dur": 0},
        {"cat": "kernel", "name": "attention", "ts": 23, "dur": 2},  # 8 us idle before it: the next window's
        {"cat": "user_annotation", "name": mark, "ts": 30, "dur": 0},
        {"cat": "kernel", "name": "after", "ts": 40, "dur": 1},  # past the last read: in no window
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    windows = prompt_step_idle.busy_and_idle(trace)
    assert [(busy, idle) for busy, idle, _ in windows] == [(14.0, 0.0), (2.0, 8.0)]
    assert [dict(by_name) for _, _, by_name in windows] == [{"gemm": 10.0, "norm": 4.0}, {"attention": 2.0}]
