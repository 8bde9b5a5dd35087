"""YOCO on and off side by side: a fresh server per setting, a workload's runs against each, the ratios.

    python bench/serving_ab.py --workload fast-prefill --model gemma-4-E4B-it --load-format dummy
    python bench/serving_ab.py --workload chat --yoco on off --out-dir results --model gemma-4-E2B-it \\
        --load-format dummy --max-running-requests 48

Every argument this script does not define goes to `python -m srt.launch_server`, with the workload's server
flags (--disable-radix-cache for fast-prefill and yoco-30x7000; bench/serving_workloads.py) and --port. For
each GEMMA4_YOCO setting (--yoco; default: the workload's, on then off) it starts the server, waits for
/health, checks that the model's log says YOCO is on or off as asked, runs each of the workload's runs
through bench_serving (its warm-up requests first, not timed), and stops the server with SIGTERM. It prints
each run's summary, then per run TTFT, TPOT and ITL (mean and p99), E2E and throughput of each setting side
by side with off / on ratios (for latencies > 1 means YOCO on is faster; for throughputs < 1 does), and
writes OUT_DIR/ab-WORKLOAD.json (every run's metrics and per-request records), ab-WORKLOAD.png (the latency
bars) and the server logs (ab-WORKLOAD-yoco-on.log, ...). --time-limit bounds the whole command: a run that
would pass it is cancelled, later ones are skipped, and what finished is still reported (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import bench_serving
import httpx
from serving_metrics import BenchmarkMetrics, metrics_from_json
from serving_server import ServerProcess, start_server
from serving_workloads import WORKLOADS, get_workload

SETTINGS = {"on": True, "off": False}
# (label, metrics field, stat): the rows of the side-by-side table
ROWS = [
    ("TTFT mean (ms)", "ttft_ms", "mean"),
    ("TTFT p99 (ms)", "ttft_ms", "p99"),
    ("TPOT mean (ms)", "tpot_ms", "mean"),
    ("TPOT p99 (ms)", "tpot_ms", "p99"),
    ("ITL mean (ms)", "itl_ms", "mean"),
    ("ITL p50 (ms)", "itl_ms", "p50"),  # the decode step: mean and p99 also hold waits for other prefills
    ("ITL p99 (ms)", "itl_ms", "p99"),
    ("E2E mean (ms)", "e2e_ms", "mean"),
    ("Output tok/s", "output_throughput", None),
    ("Total tok/s", "total_throughput", None),
    ("Tokens per chunk", "tokens_per_chunk", None),  # 1.000: every token streamed alone, ITL is per token
    # with --emit-timestamps: ITL as the scheduler emitted tokens, and how long the client took to parse them
    ("Server ITL p50 (ms)", "server_itl_ms", "p50"),
    ("Client lag p50 (ms)", "emit_lag_ms", "client.p50"),
    ("Client lag p99 (ms)", "emit_lag_ms", "client.p99"),
]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the rest: the server's."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--workload", required=True, choices=list(WORKLOADS))
    parser.add_argument("--yoco", nargs="+", choices=list(SETTINGS), help="GEMMA4_YOCO settings, in order.")
    parser.add_argument("--port", type=int, default=30000, help="The servers' port (one server at a time).")
    parser.add_argument("--out-dir", type=Path, default=Path("serving-ab"), help="Where results and logs go.")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="Seconds for a server to get ready.")
    parser.add_argument("--time-limit", type=float, help="Seconds for the whole command (default: none).")
    parser.add_argument("--stream-logprobs", action="store_true", help="See bench_serving.py --help.")
    parser.add_argument("--emit-timestamps", action="store_true", help="See bench_serving.py --help.")
    parser.add_argument("--client-processes", type=int, help="See bench_serving.py --help.")
    return parser.parse_known_args(argv)


def metric(metrics: BenchmarkMetrics | None, name: str, stat: str | None) -> float | None:
    """One number of `metrics`: field `name`, its `stat`; "stage.stat" picks a stage of emit_lag_ms."""
    value = None if metrics is None else getattr(metrics, name)
    if stat is not None and "." in stat and value is not None:
        stage, stat = stat.split(".")
        value = value.get(stage)
    return value if stat is None or value is None else getattr(value, stat)


def run_setting(
    args: argparse.Namespace, server_args: list[str], result: dict, deadline: float, started: list[ServerProcess]
) -> None:
    """Start a server with GEMMA4_YOCO as `result["yoco"]` says, run every run of the workload, stop it.

    Fills `result` as it goes, so that what finished survives an error or an interruption; the server goes
    into `started` so that the caller can stop it should an interruption cut this function's own stop short."""
    workload, yoco = get_workload(args.workload), result["yoco"]
    log = args.out_dir / f"ab-{workload.name}-yoco-{yoco}.log"
    result["server_log"] = str(log)
    flags = [*server_args, *(f for f in workload.server_args if f not in server_args)]
    remaining = deadline - time.monotonic()
    env = {"GEMMA4_YOCO": "1" if SETTINGS[yoco] else "0"}
    server = start_server(flags, args.port, env, log, min(args.startup_timeout, remaining))
    started.append(server)
    result["startup_s"], result["pid"] = server.startup_s, server.proc.pid
    try:
        result["yoco_logged"] = logged = server.logged_yoco()
        if logged in SETTINGS and logged != yoco:
            raise RuntimeError(f"GEMMA4_YOCO asked for YOCO {yoco}; the server's model says {logged} ({log})")
        bench_argv = ["--base-url", server.url, "--workload", workload.name, "--disable-tqdm"]
        bench_argv += ["--stream-logprobs"] if args.stream_logprobs else []
        bench_argv += ["--emit-timestamps"] if args.emit_timestamps else []
        bench_argv += ["--client-processes", str(args.client_processes)] if args.client_processes else []
        bench_args = bench_serving.parse_args(bench_argv)
        facts = bench_serving.discover_server(server.url)
        for run in bench_args.runs:
            title = f"{workload.name}, YOCO {yoco}: concurrency {run.concurrency}, {run.num_prompts} prompts"
            print(f"=== {title}", file=sys.stderr, flush=True)
            remaining = deadline - time.monotonic()
            try:
                done = bench_serving.run_one(bench_args, run, facts, remaining if math.isfinite(remaining) else None)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                result["error"] = f"the run at concurrency {run.concurrency} was cancelled at the time limit"
                break
            print(bench_serving.format_summary(done.metrics, bench_args.backend, facts.model, title), flush=True)
            records = [asdict(r) for r in done.records]
            result["runs"].append({"run": asdict(run), "metrics": asdict(done.metrics), "requests": records})
        info = httpx.get(f"{server.url}/server_info", timeout=30).raise_for_status().json()
        result["server_info"] = {key: info.get(key) for key in ("server_args", "generated_tokens_total", "pools")}
    finally:
        result["exit_code"] = server.stop()


def side_by_side(workload_name: str, settings: list[dict]) -> str:
    """Per run: each metric of every setting in a column, then off / on where both ran."""
    lines = []
    runs = get_workload(workload_name).runs
    names = [s["yoco"] for s in settings]
    ratio = "on" in names and "off" in names
    for index, run in enumerate(runs):
        lines.append(f"\n{workload_name}: concurrency {run.concurrency}, {run.num_prompts} prompts")
        header = f"{'':<18}" + "".join(f"{'YOCO ' + n:>14}" for n in names) + (f"{'off / on':>12}" if ratio else "")
        lines.append(header)
        metrics = {s["yoco"]: _metrics(s, index) for s in settings}
        for label, name, stat in ROWS:
            values = {n: metric(metrics[n], name, stat) for n in names}
            row = f"{label:<18}" + "".join(f"{_fmt(values[n]):>14}" for n in names)
            if ratio:
                on, off = values["on"], values["off"]
                row += f"{(f'{off / on:.3f}' if on and off is not None else 'n/a'):>12}"
            lines.append(row)
        ok = "".join(f"{_completed(metrics[n], run.num_prompts):>14}" for n in names)
        lines.append(f"{'Requests ok':<18}{ok}")
    return "\n".join(lines)


def write_plot(workload_name: str, settings: list[dict], path: Path) -> None:
    """Bars of TTFT, TPOT and ITL (mean and p99) per setting, one row of panels per run."""
    from matplotlib.figure import Figure

    runs = get_workload(workload_name).runs
    fig = Figure(figsize=(12, 3.5 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 3, squeeze=False)
    for index, run in enumerate(runs):
        for ax, name in zip(axes[index], ("ttft_ms", "tpot_ms", "itl_ms")):
            for offset, setting in enumerate(settings):
                values = [metric(_metrics(setting, index), name, stat) or 0.0 for stat in ("mean", "p99")]
                ax.bar([x + 0.4 * offset for x in (0, 1)], values, width=0.4, label=f"YOCO {setting['yoco']}")
            ax.set(title=f"{name[:-3].upper()}, concurrency {run.concurrency}", ylabel="ms", xticks=[0.2, 1.2])
            ax.set_xticklabels(["mean", "p99"])
            ax.legend()
    fig.suptitle(f"{workload_name}: YOCO on / off")
    fig.savefig(path, dpi=100)


def _metrics(setting: dict, index: int) -> BenchmarkMetrics | None:
    runs = setting["runs"]
    return metrics_from_json(runs[index]["metrics"]) if index < len(runs) else None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _completed(metrics: BenchmarkMetrics | None, num_prompts: int) -> str:
    return "n/a" if metrics is None else f"{metrics.completed}/{num_prompts}"


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(argv)
    workload = get_workload(args.workload)
    yocos = args.yoco or [yoco for yoco, on in SETTINGS.items() if on in workload.yoco]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.time_limit if args.time_limit else float("inf"))
    settings: list[dict] = []
    started: list[ServerProcess] = []
    problem = None

    def interrupt(*_: object) -> None:  # `timeout` sends SIGTERM: end like Ctrl-C, once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        for yoco in yocos:
            if time.monotonic() >= deadline:
                problem = f"the time limit was reached before YOCO {yoco}"
                break
            setting = {"yoco": yoco, "runs": [], "error": None}
            settings.append(setting)
            try:
                run_setting(args, server_args, setting, deadline, started)
            except Exception as error:  # the report still gets written, with what finished
                traceback.print_exc()
                setting["error"] = str(error)
            if setting["error"]:
                problem = f"YOCO {yoco}: {setting['error']}"
                break
    except KeyboardInterrupt:
        problem = "interrupted"
        if settings:
            settings[-1]["error"] = problem
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the servers' shutdown and the report are not cut short
        for server in started:
            server.stop(timeout_s=10)
    report = {
        "workload": asdict(workload),
        "server_args": server_args,
        "complete": problem is None,
        "problem": problem,
        "settings": settings,
    }
    out = args.out_dir / f"ab-{workload.name}.json"
    out.write_text(json.dumps(report, indent=1, allow_nan=False))
    if settings:
        print(side_by_side(workload.name, settings))
        try:
            write_plot(workload.name, settings, args.out_dir / f"ab-{workload.name}.png")
        except ImportError:  # matplotlib is optional on a GPU machine; the table and JSON hold the numbers
            print("no plot: matplotlib is not installed", file=sys.stderr)
    print(f"\nresults: {out}")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
