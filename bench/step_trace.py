"""Where a served request's time goes, from a scheduler's step trace (`SRT_STEP_TRACE`, srt/managers/step_trace.py).

    SRT_STEP_TRACE=/tmp/trace python -m srt.entrypoints.launch_server ...   # then run the clients
    python bench/step_trace.py /tmp/trace              # reads /tmp/trace.<pid> of every scheduler process

The trace is cut into bursts of work (no event for --idle seconds between them: one benchmark run each).
Per burst it prints the steps by kind (prompt steps: steps that carry prompt tokens; decode steps) with their
wall time (launch to the host's read of the tokens, or from the read of the step before where the step was
launched before that read, as the overlap schedule does; decode steps: the burst's decode time / steps), the
host's gap between a prompt step's read and the next launch where no step was in flight (and the host's
stretches between the trace's `mark` points after each prompt step's read), and per request where the time to its
first token went in the scheduler: queued (arrival to the launch of its first prompt chunk) and computed (that
launch to the read of its first token).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections import deque
from pathlib import Path

import numpy as np


def load_events(prefix: str) -> list[dict]:
    events = []
    for path in sorted(glob.glob(f"{prefix}.*")):
        events += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def bursts(events: list[dict], idle_s: float) -> list[list[dict]]:
    """Runs of events with no gap longer than `idle_s`."""
    runs: list[list[dict]] = []
    for event in events:
        if not runs or event["t"] - runs[-1][-1]["t"] > idle_s:
            runs.append([])
        runs[-1].append(event)
    return runs


def stats_ms(values: list[float]) -> str:
    if not values:
        return "-"
    ms = np.array(values) * 1e3
    p50, p90 = np.percentile(ms, [50, 90])
    return f"n {len(ms):4d}  mean {ms.mean():8.2f}  p50 {p50:8.2f}  p90 {p90:8.2f} ms"


def summarize(events: list[dict]) -> dict[str, list[float]]:
    """Step times, host gaps and per-request waits (seconds) of one burst."""
    launches: deque[dict] = deque()
    out: dict[str, list[float]] = {"prompt step": [], "host gap after a prompt step": [], "queued": [], "computed": []}
    arrived: dict[str, float] = {}
    admitted: dict[str, float] = {}
    last_finish: float | None = None
    last_finish_kind = ""
    decode_time, decode_steps = 0.0, 0
    for event in events:
        kind = event["event"]
        if kind == "arrive":
            arrived[event["rid"]] = event["t"]
        elif kind == "launch":
            if last_finish is not None and last_finish_kind == "prompt" and not launches:
                out["host gap after a prompt step"].append(event["t"] - last_finish)
            for rid in event["admitted"]:
                admitted.setdefault(rid, event["t"])
            launches.append(event)
        elif kind == "finish" and launches:
            launch = launches.popleft()
            step_kind = "prompt" if launch["prompt_tokens"] else "decode"
            if step_kind == "prompt":  # launched before the read of the step before it: from that read
                out["prompt step"].append(event["t"] - max(launch["t"], last_finish or launch["t"]))
            else:
                decode_steps += 1
                decode_time += event["t"] - (last_finish if last_finish is not None else launch["t"])
            last_finish, last_finish_kind = event["t"], step_kind
            for rid in event["first_token"]:
                if rid in admitted and rid in arrived:
                    out["queued"].append(admitted[rid] - arrived[rid])
                    out["computed"].append(event["t"] - admitted[rid])
    out["decode step (read to read)"] = [decode_time / decode_steps] * decode_steps if decode_steps else []
    return out


def gap_stretches(events: list[dict]) -> dict[str, list[float]]:
    """After each prompt step's read: the host's stretches (`mark` points, arrivals, the launch) up to the next
    forward call, each as "from -> to" with one duration (seconds) per prompt step."""
    stretches: dict[str, list[float]] = {}
    launches: deque[dict] = deque()
    previous: tuple[str, float] | None = None
    for event in events:
        kind = event["event"]
        if kind == "launch":
            launches.append(event)
        name = event.get("at", kind)
        if kind == "finish" and launches and launches.popleft()["prompt_tokens"]:
            previous = ("finish", event["t"])
            continue
        if previous is None or kind == "finish":
            continue
        stretches.setdefault(f"{previous[0]} -> {name}", []).append(event["t"] - previous[1])
        previous = None if name == "forward" else (name, event["t"])
    return stretches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="The SRT_STEP_TRACE path (files PREFIX.<pid>).")
    parser.add_argument("--idle", type=float, default=2.0, help="Seconds without events that end a burst.")
    args = parser.parse_args()
    events = load_events(args.prefix)
    if not events:
        raise SystemExit(f"no trace files {args.prefix}.*")
    for i, burst in enumerate(bursts(events, args.idle)):
        arrivals = sum(e["event"] == "arrive" for e in burst)
        prompt_tokens = sum(e.get("prompt_tokens", 0) for e in burst)
        print(f"burst {i}: {burst[-1]['t'] - burst[0]['t']:.2f} s, {arrivals} requests, {prompt_tokens} prompt tokens")
        for name, values in summarize(burst).items():
            print(f"  {name:32} {stats_ms(values)}")
        stretches = gap_stretches(burst)
        if stretches:
            print("  after a prompt step, until the next forward call:")
            for name, values in stretches.items():
                print(f"    {name:30} {stats_ms(values)}")


if __name__ == "__main__":
    main()
