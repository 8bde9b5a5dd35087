"""`bench/kernel_timeline.py`: the critical-path charge of each kernel in a profiled trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as `python bench/<script>.py` has it
    import kernel_timeline

    return kernel_timeline


def write_trace(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_chained_kernels_are_charged_only_past_the_one_ahead(timeline, tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "trace.json",
        [
            {"cat": "kernel", "name": "void norm_kernel<float>(float*)", "ts": 0, "dur": 5},
            {"cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 50},  # host ops are not kernels
            {"cat": "kernel", "name": "attention", "ts": 3, "dur": 4},  # started early, waited: 2 us its own
            {"cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 10, "dur": 2},  # 3 us idle before it
            {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 11, "dur": 0.5},  # inside the GEMM: 0 us
        ],
    )
    kernels = timeline.load_kernels(trace)
    assert [k.name for k in kernels] == ["norm_kernel", "attention", "nvjet_sm90_gemm", "Memcpy DtoD"]
    path = timeline.critical_path(kernels)
    assert [(e, i) for _, e, i in path] == [(5.0, 0.0), (2.0, 0.0), (2.0, 3.0), (0.0, 0.0)]
    span = kernels[-2].end - kernels[0].start
    assert sum(e + i for _, e, i in path) == span  # exclusive and idle times add up to the span


def test_an_empty_trace_has_no_path(timeline) -> None:
    assert timeline.critical_path([]) == []
