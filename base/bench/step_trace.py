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

With `--requests RUN.json` (bench_serving.py's or serving_ab.py's output, from the same machine: both clocks are
`time.time()`), each timed request's TTFT end to end: client -> scheduler (its send to the scheduler's arrival;
matched with the request whose first token the scheduler read last before the client got its own), queued, computed, and
scheduler -> client (the read of its first token to the client's arrival; with --emit-timestamps split by stage),
the first requests one by one (`--show`).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
from collections import deque
from pathlib import Path

import numpy as np
from serving_metrics import EMIT_STAGES


def read_text(path: str | Path) -> str:
    """A file's text, gunzipped where its name ends in .gz (the traces and runs kept in bench/results)."""
    return gzip.open(path, "rt").read() if str(path).endswith(".gz") else Path(path).read_text()


def load_events(prefix: str) -> list[dict]:
    """The events of every trace file PREFIX.* (PREFIX.<pid>, or a gzipped copy), in time order."""
    events = []
    for path in sorted(glob.glob(f"{prefix}.*")):
        events += [json.loads(line) for line in read_text(path).splitlines() if line.strip()]
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


def request_times(events: list[dict]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per request id: when it arrived, when its first prompt chunk was launched, when its first token was read."""
    arrived: dict[str, float] = {}
    admitted: dict[str, float] = {}
    first_read: dict[str, float] = {}
    for event in events:
        if event["event"] == "arrive":
            arrived[event["rid"]] = event["t"]
        elif event["event"] == "launch":
            for rid in event["admitted"]:
                admitted.setdefault(rid, event["t"])
        elif event["event"] == "finish":
            for rid in event["first_token"]:
                first_read.setdefault(rid, event["t"])
    return arrived, admitted, first_read


def summarize(events: list[dict]) -> dict[str, list[float]]:
    """Step times, host gaps and per-request waits (seconds) of one burst."""
    launches: deque[dict] = deque()
    out: dict[str, list[float]] = {"prompt step": [], "host gap after a prompt step": []}
    last_finish: float | None = None
    last_finish_kind = ""
    decode_time, decode_steps = 0.0, 0
    for event in events:
        kind = event["event"]
        if kind == "launch":
            if last_finish is not None and last_finish_kind == "prompt" and not launches:
                out["host gap after a prompt step"].append(event["t"] - last_finish)
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
    arrived, admitted, first_read = request_times(events)
    timed = [rid for rid in first_read if rid in admitted and rid in arrived]
    out["queued"] = [admitted[rid] - arrived[rid] for rid in timed]
    out["computed"] = [first_read[rid] - admitted[rid] for rid in timed]
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


def request_records(path: Path) -> list[dict]:
    """The timed requests of a bench_serving.py or serving_ab.py JSON that carry their send time."""
    data = json.loads(read_text(path))
    runs = [run for setting in data.get("settings", []) for run in setting.get("runs", [])] or [data]
    return sorted((r for run in runs for r in run["requests"] if r.get("sent_at")), key=lambda r: r["sent_at"])


def ttft_breakdown(events: list[dict], records: list[dict]) -> list[dict[str, float]]:
    """Per timed request (in send order): its TTFT end to end and the stretches of it (seconds).

    A request is matched with the scheduler's request that arrived after it was sent and whose first token was
    read last before the client got its first token (among requests of one step: the earliest arrival)."""
    arrived, admitted, first_read = request_times(events)
    free = {rid for rid in arrived if rid in admitted and rid in first_read}
    rows = []
    for record in sorted((r for r in records if r.get("ttft_s")), key=lambda r: r["sent_at"] + r["ttft_s"]):
        received = record["sent_at"] + record["ttft_s"]
        candidates = [rid for rid in free if arrived[rid] >= record["sent_at"] and first_read[rid] <= received]
        if not candidates:
            continue
        rid = max(candidates, key=lambda rid: (first_read[rid], -arrived[rid]))
        free.remove(rid)
        row = {
            "sent": record["sent_at"],
            "ttft": record["ttft_s"],
            "client -> scheduler": arrived[rid] - record["sent_at"],
            "queued": admitted[rid] - arrived[rid],
            "computed": first_read[rid] - admitted[rid],
            "scheduler -> client": received - first_read[rid],
        }
        stamps = record.get("first_emit_ts") or {}
        if "scheduler" in stamps:
            row["  read -> emitted"] = stamps["scheduler"] - first_read[rid]
            for before, stage in zip(EMIT_STAGES, EMIT_STAGES[1:]):
                row[f"  -> {stage}"] = stamps[stage] - stamps[before]
        rows.append(row)
    rows.sort(key=lambda row: row.pop("sent"))
    return rows


def print_breakdown(rows: list[dict[str, float]], show: int) -> None:
    print(f"TTFT end to end, {len(rows)} timed requests matched with the trace:")
    for name in dict.fromkeys(name for row in rows for name in row):
        print(f"  {name:32} {stats_ms([row[name] for row in rows if name in row])}")
    for i, row in enumerate(rows[:show]):
        print(f"  request {i:3d}: " + "  ".join(f"{name.strip()} {value * 1e3:.1f}" for name, value in row.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="The SRT_STEP_TRACE path (files PREFIX.<pid>).")
    parser.add_argument("--idle", type=float, default=2.0, help="Seconds without events that end a burst.")
    parser.add_argument("--requests", type=Path, help="A bench_serving.py / serving_ab.py JSON of the same runs.")
    parser.add_argument("--show", type=int, default=16, help="With --requests: the first requests one by one.")
    args = parser.parse_args()
    events = load_events(args.prefix)
    if not events:
        raise SystemExit(f"no trace files {args.prefix}.*")
    if args.requests is not None:
        print_breakdown(ttft_breakdown(events, request_records(args.requests)), args.show)
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
