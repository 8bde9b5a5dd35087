"""Load generator for an OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency and throughput.

Every request streams (`stream=True`) and the client times the arrival of each streamed chunk; the metrics
are defined as vLLM's and SGLang's bench_serving define them (serving_metrics.py):
    TTFT   time from sending the request to the first chunk that carries output
    ITL    every gap between two consecutive token arrivals
    TPOT   (E2E - TTFT) / (output_tokens - 1), per request
    E2E    time from sending the request to the end of its stream
What a chunk holds: srt streams one chunk per decode step that produced text, so a chunk is a token as long
as every token decodes to text. With a real checkpoint's tokenizer, or srt's full-vocabulary stand-in for a
dummy published preset (docs/usage.md), it does. "Output tokens per chunk" in the summary (server's token
count / chunks) says whether it held: 1.000 means each chunk was one token. `--stream-logprobs` counts the
tokens of each chunk exactly (by its logprob entries) for servers that merge tokens into chunks; it is
opt-in because it makes the server compute a log-softmax over the vocabulary for every token it samples.
Output tokens are counted from the server's `usage` (`stream_options.include_usage`); a server that sends
no usage gets one token per output chunk (or per logprob entry).

The requests are sent and timed by client processes (serving_clients.py; --client-processes): one process
parsing every chunk of 32 fast streams cannot keep up, and then times its own backlog, not the server.
`--emit-timestamps` (srt only) checks it: the summary adds server ITL (timed by the scheduler) and the lag of
each stage down to the client's parsed chunk (serving_metrics.py).

Random dataset: each prompt is a list of token ids drawn uniformly from [3, vocab) (ids 0-2 are pad, eos and
bos in Gemma's vocabulary), sent as `prompt` of /v1/completions, so the server sees exactly `input_len`
tokens and the radix cache finds no shared prefixes. The vocabulary size comes from --vocab-size or from the
server's /server_info. Each request asks for exactly its output length: `max_tokens`, `ignore_eos` (an SGLang
extension) and temperature 0. With `--backend chat` the ids are decoded to text with --tokenizer (default: the
model path /v1/models reports) and sent as one user message; the chat template and re-tokenization make the
prompt length approximate, so input token counts come from the server's usage.

Images (`--random-image-count N --random-image-size WxH`, or `--workload random-mm`: 6 of 480x480): each chat
request's user message holds N images of random pixels as JPEG data: URLs (every one different), then the
random text; they need `--backend chat` (a workload with images selects it).

Workloads (`--workload NAME`, serving_workloads.py) set the lengths, range ratio 1, and one run per
concurrency with its prompts and warm-up requests; the runs go one after the other against the same server.
A flag given explicitly overrides the workload's value: --max-concurrency C keeps one run at C (4 x C prompts
unless --num-prompts says otherwise), --num-prompts / --warmup-requests apply to every run. The workload's
server flags (e.g. --disable-radix-cache) are the server's business: this script warns when /server_info
disagrees; bench/serving_ab.py starts servers with them. Several runs write one JSON and plot each, the
concurrency added to the name (out.json -> out-c8.json, out-c32.json).
{workloads}

Examples (a server on the default port):
    python bench/bench_serving.py --workload yoco-30x7000
    python bench/bench_serving.py --workload fast-prefill --max-concurrency 8 --output-json fp8.json
    python bench/bench_serving.py --num-prompts 200 --random-input-len 1024 --random-output-len 256 \\
        --random-range-ratio 0.5 --request-rate 4 --warmup-requests 4 --output-json out.json --plot out.png
    python bench/bench_serving.py --backend chat --num-prompts 50 --random-input-len 512 --random-output-len 128
    python bench/bench_serving.py --workload random-mm --max-concurrency 8
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
from serving_clients import ClientProcesses, Job, default_process_count
from serving_metrics import (  # noqa: F401  (re-exported: bench_serving is the module users and tests import)
    EMIT_STAGES,
    BenchmarkMetrics,
    LatencyStats,
    RequestRecord,
    arrival_timings,
    compute_metrics,
    emit_timings,
    format_summary,
    latency_stats,
    metrics_from_json,
    tpot_s,
    write_plot,
)
from serving_requests import (  # noqa: F401  (re-exported)
    FIRST_SAFE_TOKEN_ID,
    RequestSpec,
    arrival_offsets,
    as_chat_text,
    random_requests,
    sample_len,
    with_images,
)
from serving_workloads import WORKLOADS, Run, describe, get_workload, run_at
from tqdm import tqdm

# Used where neither a flag nor --workload gives a value.
DEFAULTS = {
    "num_prompts": 100,
    "random_input_len": 1024,
    "random_output_len": 128,
    "random_range_ratio": 1.0,
    "random_image_count": 0,
    "random_image_size": (480, 480),
    "backend": "completions",
}


@dataclass
class ServerFacts:
    """What the benchmark learns from the server before sending anything."""

    base_url: str
    model: str  # the name requests send
    root: str | None  # the model path /v1/models reports (the chat backend's default tokenizer)
    vocab_size: int
    server_args: dict | None  # srt's /server_info server_args; None for other servers


class WarmupFailed(RuntimeError):
    pass


@dataclass
class RunResult:
    run: Run
    records: list[RequestRecord]
    metrics: BenchmarkMetrics


def build_requests(
    args: argparse.Namespace, run: Run, vocab_size: int, tokenizer: str | None
) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(timed, warmup) requests; the timed ones are drawn first so --warmup-requests does not change them (the
    images are drawn after all prompts, from their own stream)."""
    rng = random.Random(args.seed)
    lens = (args.random_input_len, args.random_output_len, args.random_range_ratio, vocab_size, rng)
    timed = random_requests(run.num_prompts, *lens)
    warmup = random_requests(run.warmup_requests, *lens)
    if args.backend == "chat":
        if tokenizer is None:
            raise SystemExit("--backend chat needs --tokenizer (the server reports no model path)")
        timed, warmup = as_chat_text(timed, tokenizer), as_chat_text(warmup, tokenizer)
    if args.random_image_count:
        images = random.Random(args.seed + 2)
        timed = with_images(timed, args.random_image_count, args.random_image_size, images)
        warmup = with_images(warmup, args.random_image_count, args.random_image_size, images)
    return timed, warmup


def benchmark(
    args: argparse.Namespace,
    run: Run,
    model: str,
    timed: list[RequestSpec],
    warmup: list[RequestSpec],
    deadline: float | None = None,
) -> tuple[list[RequestRecord], float]:
    """Warm up, then run the timed requests from the client processes (serving_clients.py); their records and
    the run's duration in seconds. asyncio.TimeoutError past `deadline` (time.monotonic())."""

    def job(specs: list[RequestSpec], send_at: list[float]) -> Job:
        return Job(
            args.base_url, args.backend, model, args.request_timeout, args.stream_logprobs, args.emit_timestamps,
            specs, send_at, run.concurrency,
        )  # fmt: skip

    processes = args.client_processes or default_process_count(run.concurrency, len(timed))
    print(f"Sending from {processes} client processes", file=sys.stderr)
    with ClientProcesses(processes) as clients:
        if warmup:
            print(f"Warming up with {len(warmup)} requests ...", file=sys.stderr)
            records, _ = clients.run(job(warmup, [0.0] * len(warmup)), deadline)
            failed = [r.error for r in records if not r.success]
            if failed:
                raise WarmupFailed(f"{len(failed)} warmup request(s) failed, e.g. {failed[0]}")
        arrivals = random.Random(args.seed + 1)  # its own stream: the arrival times do not depend on the prompts
        send_at = arrival_offsets(len(timed), args.request_rate, arrivals)
        with tqdm(total=len(timed), disable=args.disable_tqdm, desc="requests") as progress:
            return clients.run(job(timed, send_at), deadline, progress)


def run_one(args: argparse.Namespace, run: Run, server: ServerFacts, time_limit_s: float | None = None) -> RunResult:
    """Warm up and time one run against `server`; asyncio.TimeoutError past `time_limit_s` (its requests are
    cancelled)."""
    timed, warmup = build_requests(args, run, server.vocab_size, args.tokenizer or server.root)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None
    records, duration = benchmark(args, run, server.model, timed, warmup, deadline)
    return RunResult(run, records, compute_metrics(records, duration))


# ---- server discovery -------------------------------------------------------------------------------------
def discover_server(base_url: str, model: str | None = None, vocab_size: int | None = None) -> ServerFacts:
    """The first model the server lists (its id and, as vLLM/SGLang/srt report it, its `root` path) and the
    vocabulary size (srt's /server_info unless given; other servers need --vocab-size)."""
    cards = httpx.get(f"{base_url}/v1/models", timeout=30).raise_for_status().json()["data"]
    info = None
    try:
        info = httpx.get(f"{base_url}/server_info", timeout=30).raise_for_status().json()
        vocab_size = vocab_size or int(info["model"]["vocab_size"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
        if vocab_size is None:
            message = f"cannot read the vocabulary size from {base_url}/server_info ({error}); pass --vocab-size"
            raise SystemExit(message) from None
    server_args = info.get("server_args") if isinstance(info, dict) else None
    return ServerFacts(base_url, model or cards[0]["id"], cards[0].get("root"), vocab_size, server_args)


def check_server_for_workload(server: ServerFacts, workload_name: str | None) -> None:
    """Warn when the server runs with a setting the workload's published shape excludes."""
    if workload_name is None or server.server_args is None:
        return
    workload = get_workload(workload_name)
    if workload.disables_radix_cache and not server.server_args.get("disable_radix_cache", False):
        print(
            f"warning: workload {workload.name} is defined with the radix cache off; this server has it on"
            " (restart it with --disable-radix-cache)",
            file=sys.stderr,
        )


# ---- CLI --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `--workload` resolved: lengths filled in and `args.runs` listing the runs."""
    description = __doc__.replace("{workloads}", "Workloads:\n" + describe())
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:30000", help="The server, without /v1.")
    add(
        "--backend",
        choices=["completions", "chat"],
        help="The OpenAI endpoint to load (default completions, or chat for a workload with images).",
    )
    add("--model", help="Model name to send (default: the first id of GET /v1/models).")
    add("--tokenizer", help="Tokenizer for --backend chat (default: the model path /v1/models reports).")
    add("--vocab-size", type=int, help="Token ids are drawn from [3, vocab-size) (default: /server_info).")
    add("--workload", choices=list(WORKLOADS), help="A named workload (above); explicit flags override it.")
    add("--num-prompts", type=int, help="Timed requests per run (default 100, or the workload's).")
    add("--random-input-len", type=int, help="Prompt tokens per request, the maximum (default 1024).")
    add("--random-output-len", type=int, help="Output tokens per request, the maximum (default 128).")
    add("--random-range-ratio", type=float, help="Lengths are uniform in [ratio * len, len] (default 1).")
    add("--random-image-count", type=int, help="Random images per chat request (default 0, or the workload's).")
    add(
        "--random-image-size",
        type=image_size,
        help="WIDTHxHEIGHT of each random image (default 480x480, or the workload's).",
    )
    add("--seed", type=int, default=0, help="Seeds the prompts and the arrival times.")
    add("--request-rate", type=float, default=math.inf, help="Requests/s, Poisson arrivals (inf: all at once).")
    add("--max-concurrency", type=int, help="At most this many requests open at once (a workload: its one run).")
    add("--warmup-requests", type=int, help="Requests sent (and awaited) before each timed run (default 0).")
    add("--request-timeout", type=float, default=3600.0, help="Seconds before one request counts as failed.")
    add("--stream-logprobs", action="store_true", help="Count each chunk's tokens by its logprobs (costs the server).")
    add(
        "--client-processes",
        type=int,
        help="Processes that send and time the requests (default: one per 8 open streams, at most half the"
        " cores; serving_clients.py says why). 1: every stream in one process, as before.",
    )
    add(
        "--emit-timestamps",
        action="store_true",
        help="Ask srt for each chunk's emit times; report server ITL and where tokens wait (serving_metrics.py).",
    )
    add("--output-json", type=Path, help="Write config, metrics and per-request records here.")
    add("--plot", type=Path, help="Write latency CDFs here (PNG; needs matplotlib).")
    add("--disable-tqdm", action="store_true", help="No progress bar.")
    args = parser.parse_args(argv)
    resolve_runs(args)
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("--random-range-ratio must be in [0, 1]")
    if min(run.num_prompts for run in args.runs) < 1 or min(args.random_input_len, args.random_output_len) < 1:
        parser.error("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        parser.error("--request-rate must be > 0 and --max-concurrency >= 1")
    if args.warmup_requests is not None and args.warmup_requests < 0:
        parser.error("--warmup-requests must be >= 0")
    if args.client_processes is not None and args.client_processes < 1:
        parser.error("--client-processes must be >= 1")
    if args.random_image_count < 0:
        parser.error("--random-image-count must be >= 0")
    if args.random_image_count and args.backend != "chat":
        parser.error("images (--random-image-count) need --backend chat")
    return args


def image_size(text: str) -> tuple[int, int]:
    """`WIDTHxHEIGHT` -> (width, height), both >= 1."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or min(int(width), int(height)) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 480x480, got {text!r}")
    return int(width), int(height)


def resolve_runs(args: argparse.Namespace) -> None:
    """Fill lengths and `args.runs` from --workload, the explicit flags (which win) and DEFAULTS."""
    workload = get_workload(args.workload) if args.workload else None
    given = {key: getattr(args, key) for key in DEFAULTS}
    if workload is not None:
        defaults = {"random_input_len": workload.input_len, "random_output_len": workload.output_len}
        defaults.update(backend=workload.backend, random_image_count=workload.images)
        if workload.images:
            defaults["random_image_size"] = workload.image_size
        runs = list(workload.runs)
        if args.max_concurrency is not None:
            runs = [run_at(args.max_concurrency)]
    else:
        defaults = {}
        runs = [Run(args.max_concurrency, DEFAULTS["num_prompts"], 0)]
    for key, value in given.items():
        setattr(args, key, value if value is not None else defaults.get(key, DEFAULTS[key]))
    if given["num_prompts"] is not None:
        runs = [replace(run, num_prompts=args.num_prompts) for run in runs]
    if args.warmup_requests is not None:
        runs = [replace(run, warmup_requests=args.warmup_requests) for run in runs]
    args.runs = runs


def run_paths(path: Path | None, run: Run, runs: list[Run]) -> Path | None:
    """Where one run's file goes: `path` itself for a single run, else with the run's concurrency added."""
    if path is None or len(runs) == 1:
        return path
    return path.with_name(f"{path.stem}-c{run.concurrency}{path.suffix}")


def run_config(args: argparse.Namespace, run: Run, server: ServerFacts) -> dict:
    """The JSON's config: the flags as resolved for this run, and what the server told us."""
    config = {key: _jsonable(value) for key, value in vars(args).items() if key != "runs"}
    config.update(num_prompts=run.num_prompts, max_concurrency=run.concurrency, warmup_requests=run.warmup_requests)
    return {**config, "model": server.model, "vocab_size": server.vocab_size}


def write_report(path: Path, config: dict, result: RunResult) -> None:
    report = {"config": config, "metrics": asdict(result.metrics), "requests": [asdict(r) for r in result.records]}
    path.write_text(json.dumps(report, indent=2, allow_nan=False))


def main(argv: list[str] | None = None) -> list[RunResult]:
    """Run the benchmark the command line describes; print each run's summary and write the requested files."""
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    server = discover_server(args.base_url, args.model, args.vocab_size)
    check_server_for_workload(server, args.workload)
    results = []
    for run in args.runs:
        try:
            result = run_one(args, run, server)
        except WarmupFailed as error:
            raise SystemExit(str(error)) from None
        results.append(result)
        title = "Serving benchmark"
        if args.workload:
            title = f"{args.workload}: concurrency {run.concurrency}, {run.num_prompts} prompts"
        print(format_summary(result.metrics, args.backend, server.model, title))
        for error in [r.error for r in result.records if not r.success][:3]:
            print(f"failed: {error}", file=sys.stderr)
        json_path, plot_path = run_paths(args.output_json, run, args.runs), run_paths(args.plot, run, args.runs)
        if json_path:
            write_report(json_path, run_config(args, run, server), result)
        if plot_path:
            write_plot(result.records, result.metrics, plot_path, f"{args.backend} · {server.model} · {title}")
    return results


def _jsonable(value: object) -> object:
    """Paths as strings and inf (the default request rate) as "inf": strict JSON has no Infinity."""
    if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
        return str(value)
    return value


if __name__ == "__main__":
    sys.exit(0 if all(result.metrics.completed for result in main()) else 1)
