"""Helpers shared by the bench scripts: median device time of a call, CUDA-graph capture, host time, and where
the results JSON goes (`write_json`).

The scripts run as `python bench/<script>.py`, which puts bench/ first on sys.path, so they import this
module as `timing` (with or without PYTHONPATH=.).

On CUDA, `time_cuda` brackets each call with CUDA events, so it measures device time and not the host's
launch latency (`time_host` measures that); with `flush_l2` a 256 MiB buffer is zeroed before each call so
weights come from HBM, as in a real forward where other layers' weights have evicted them. On a CPU device
both fall back to `time.perf_counter`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

L2_FLUSH_BYTES = 256 * 1024**2  # well above the L2 of current GPUs (H100: 50 MiB)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph (raises on any host synchronisation inside it).

    Two warm-up calls on a side stream first: lazy initialisation (cuBLAS handles, Triton compilation) must
    not happen during capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_cuda(
    fn: Callable[[], object],
    warmup: int = 10,
    repeats: int = 100,
    use_graph: bool = False,
    flush_l2: bool = False,
    device: torch.device | str | None = None,
) -> float:
    """Median seconds of one call of `fn` over `repeats` calls, after `warmup` untimed ones.

    `use_graph` times replays of `fn` captured in a CUDA graph (no launch gaps between its kernels). On a CPU
    device, wall time per call (`use_graph` and `flush_l2` do not apply).
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)
    call = capture_graph(fn).replay if use_graph else fn  # the bound method keeps the graph alive
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if flush_l2 else None
    for _ in range(warmup):
        call()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()  # outside the events: the flush itself is not timed
        start.record()
        call()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends)) / 1e3


def time_host(fn: Callable[[], object], calls: int = 50, device: torch.device | str | None = None) -> float:
    """Wall seconds per call of `calls` calls back to back: what an eager step pays, launch overheads included."""
    device = torch.device(device) if device is not None else default_device()
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def write_json(path: Path | None, default_name: str, payload: dict, indent: int = 1) -> Path | None:
    """Write `payload` to `path` (a script's --json), or to $OUT/`default_name` when $OUT is set (the device
    tool's output folder), or nowhere; returns where it went."""
    if path is None and os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / default_name
    if path is not None:
        path.write_text(json.dumps(payload, indent=indent))
        print(f"wrote {path}")
    return path


def print_kernel_resources(*kernels: object) -> None:
    """Registers, spills and shared memory of every variant of these Triton kernels compiled so far (what
    bounds how many CTAs an SM holds)."""
    for kernel in kernels:
        for device, caches in getattr(kernel, "device_caches", {}).items():
            for compiled in caches[0].values():
                if getattr(compiled, "n_regs", None) is None:  # loaded lazily: compiled but never launched
                    try:
                        compiled._init_handles()
                    except Exception:  # e.g. a block shape needing more shared memory than the chip has
                        continue
                meta = compiled.metadata
                print(
                    f"{kernel.__name__} (device {device}): {compiled.n_regs} registers, {compiled.n_spills} spills,"
                    f" {meta.shared} B shared, {meta.num_warps} warps, {meta.num_stages} stages"
                )
