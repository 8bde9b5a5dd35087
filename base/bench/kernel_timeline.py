"""Where a profiled step's device time goes along its critical path, from a torch.profiler Chrome trace.

    python bench/kernel_timeline.py TRACE.json [--steps 4] [--layer-marker _qkv_norm_rope_store_kernel]

Kernel durations alone mislead for chained kernels (programmatic dependent launch): a chained kernel starts
early and waits for the one ahead, so its duration holds that wait. Here the kernels, in start order, are
charged only the time by which each pushes the end of the work so far:

    exclusive(k) = max(0, end(k) - max(start(k), latest end before k))
    idle before k = max(0, start(k) - latest end before k)       (no kernel runs: launch gaps, host waits)

so that the exclusive times and the idle times add up to the span of the trace. It prints both per kernel
name (per step: divided by --steps), and one layer's kernels in order: those from the --layer-marker'th
occurrence of the marker to the next (the marker is a kernel that runs once per layer).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple


class Kernel(NamedTuple):
    name: str
    start: float  # us
    end: float


def load_kernels(trace: Path) -> list[Kernel]:
    return kernels_of(json.loads(trace.read_text())["traceEvents"])


def kernels_of(events: list[dict]) -> list[Kernel]:
    """The device kernels, copies and memsets of a Chrome trace's events, in start order."""
    kernels = [
        Kernel(short_name(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(kernels, key=lambda k: k.start)


def short_name(name: str) -> str:
    name = name.removeprefix("void ")
    return name.split("(")[0].split("<")[0][:60] if not name.startswith("nvjet") else name


def critical_path(kernels: list[Kernel]) -> list[tuple[Kernel, float, float]]:
    """(kernel, exclusive us, idle us before it) for each kernel in start order."""
    out = []
    latest = kernels[0].start if kernels else 0.0
    for kernel in kernels:
        idle = max(0.0, kernel.start - latest)
        exclusive = max(0.0, kernel.end - max(kernel.start, latest))
        out.append((kernel, exclusive, idle))
        latest = max(latest, kernel.end)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds (totals are per step)")
    parser.add_argument("--layer-marker", default="_qkv_norm_rope_store_kernel")
    parser.add_argument("--layer-index", type=int, default=6, help="which occurrence of the marker")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    path = critical_path(load_kernels(args.trace))
    if not path:
        raise SystemExit("no kernels in the trace")
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for kernel, exclusive, idle in path:
        row = totals[kernel.name]
        row[0] += 1
        row[1] += exclusive
        row[2] += idle
        row[3] += kernel.end - kernel.start
    span = path[-1][0].end - path[0][0].start
    busy = sum(e for _, e, _ in path)
    print(f"span {span / args.steps:.1f} us/step: kernels on the critical path {busy / args.steps:.1f}, "
          f"idle {(span - busy) / args.steps:.1f}, {len(path) / args.steps:.0f} kernels/step")  # fmt: skip
    print(f"{'kernel':<62} {'n/step':>6} {'excl us':>9} {'idle us':>8} {'dur us':>9}  (per step)")
    for name, (count, exclusive, idle, duration) in sorted(totals.items(), key=lambda t: -(t[1][1] + t[1][2]))[
        : args.rows
    ]:
        s = args.steps
        print(f"{name:<62} {count / s:>6.0f} {exclusive / s:>9.1f} {idle / s:>8.1f} {duration / s:>9.1f}")
    markers = [i for i, (k, _, _) in enumerate(path) if k.name == args.layer_marker]
    if len(markers) > args.layer_index + 1:
        first, last = markers[args.layer_index], markers[args.layer_index + 1]
        print(f"\none layer ({args.layer_marker} #{args.layer_index} to the next): exclusive, idle before, duration")
        for kernel, exclusive, idle in path[first:last]:
            print(f"  {kernel.name:<62} {exclusive:7.2f} {idle:6.2f} {kernel.end - kernel.start:7.2f}")
        print(f"  total {sum(e + i for _, e, i in path[first:last]):.2f} us")


if __name__ == "__main__":
    main()
