"""Load generator for an OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency and throughput.

Every request streams (`stream=True`), so the arrival of each chunk is timed on the client:
    TTFT   time from sending the request to the first chunk that carries output
    ITL    every gap between two consecutive output chunks
    TPOT   (e2e - TTFT) / (output_tokens - 1), per request; undefined for one output token
    E2E    time from sending the request to the end of its stream
Output tokens are counted from the server's `usage` (asked for with `stream_options.include_usage`); a server
that sends no usage gets one token per output chunk, which undercounts if it merges tokens into a chunk.

Random dataset: each prompt is a list of token ids drawn uniformly from [3, vocab) (ids 0-2 are pad, eos and
bos in Gemma's vocabulary), sent as `prompt` of /v1/completions, so the server sees exactly `input_len`
tokens and the radix cache finds no shared prefixes. The vocabulary size comes from --vocab-size or from the
server's /server_info. Each request asks for exactly its output length: `max_tokens`, `ignore_eos` (an SGLang
extension) and temperature 0. With `--backend chat` the ids are decoded to text with --tokenizer (default: the
model path /v1/models reports) and sent as one user message; the chat template and re-tokenization make the
prompt length approximate, so input token counts come from the server's usage.

Examples (a server on the default port):
    python bench/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 30 \
        --random-input-len 7000 --random-output-len 10 --max-concurrency 30
    python bench/bench_serving.py --num-prompts 200 --random-input-len 1024 --random-output-len 256 \
        --random-range-ratio 0.5 --request-rate 4 --warmup-requests 4 --output-json out.json --plot out.png
    python bench/bench_serving.py --backend chat --num-prompts 50 --random-input-len 512 --random-output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
from tqdm import tqdm

FIRST_SAFE_TOKEN_ID = 3  # Gemma: 0 <pad>, 1 <eos>, 2 <bos>
PERCENTILES = (50, 90, 99)


@dataclass
class RequestSpec:
    """One request to send: a prompt (token ids, or text for chat) and the output length to ask for."""

    prompt: list[int] | str
    input_len: int
    output_len: int


@dataclass
class RequestRecord:
    """What one request measured on the client (seconds since it was sent)."""

    input_len: int  # the server's prompt_tokens when it reports usage, else the prompt's length
    output_len: int  # requested
    success: bool = False
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class LatencyStats:
    """Mean and percentiles of one latency, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    input_throughput: float  # tokens/s
    output_throughput: float
    total_throughput: float
    mean_concurrency: float  # summed request latency / duration
    ttft_ms: LatencyStats | None
    tpot_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None


# ---- dataset ----------------------------------------------------------------------------------------------
def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length uniform in [range_ratio * length, length] (at least 1)."""
    return rng.randint(max(1, int(range_ratio * length)), max(1, length))


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, rng: random.Random
) -> list[RequestSpec]:
    """`num` prompts of random token ids in [FIRST_SAFE_TOKEN_ID, vocab_size) with random lengths."""
    specs = []
    for _ in range(num):
        n_in, n_out = sample_len(rng, input_len, range_ratio), sample_len(rng, output_len, range_ratio)
        ids = [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size) for _ in range(n_in)]
        specs.append(RequestSpec(ids, n_in, n_out))
    return specs


def as_chat_text(specs: list[RequestSpec], tokenizer_path: str) -> list[RequestSpec]:
    """The same requests with their ids decoded to text (chat messages carry text, not ids)."""
    from transformers import AutoTokenizer  # only the chat backend needs a tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [RequestSpec(tokenizer.decode(s.prompt, skip_special_tokens=True), s.input_len, s.output_len) for s in specs]


# ---- one request ------------------------------------------------------------------------------------------
async def open_stream(client: openai.AsyncOpenAI, backend: str, model: str, spec: RequestSpec) -> openai.AsyncStream:
    """Start one streamed request that asks for exactly `spec.output_len` tokens."""
    common = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    if backend == "chat":
        return await client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}], **common)
    # Token ids travel in extra_body, which the SDK sends as it is: passed as `prompt`, the SDK type-checks
    # every id in Python (~0.1 s per 7000 ids) on the event loop that is timing the other requests.
    common["extra_body"] = {**common["extra_body"], "prompt": spec.prompt}
    return await client.completions.create(prompt="", **common)


def carries_output(choice: Any) -> bool:
    """Whether a streamed choice is output: text, or the end (not chat's opening role-only delta)."""
    text = choice.delta.content if hasattr(choice, "delta") else choice.text
    return bool(text) or choice.finish_reason is not None


async def send_request(client: openai.AsyncOpenAI, backend: str, model: str, spec: RequestSpec) -> RequestRecord:
    """Send one request, time its chunks; a failure is recorded, not raised."""
    record = RequestRecord(input_len=spec.input_len, output_len=spec.output_len)
    chunks, usage = 0, None
    start = last = time.perf_counter()
    try:
        stream = await open_stream(client, backend, model, spec)
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage or usage
            if not any(carries_output(choice) for choice in chunk.choices):
                continue
            if chunks == 0:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - last)
            chunks, last = chunks + 1, now
        record.e2e_s = time.perf_counter() - start
    except Exception as error:  # any failure of one request is a data point, not the end of the run
        record.error = f"{type(error).__name__}: {error}"
        return record
    if chunks == 0:
        record.error = "the stream ended without output"
        return record
    record.output_tokens = usage.completion_tokens if usage else chunks
    record.input_len = usage.prompt_tokens if usage else spec.input_len
    record.success = True
    return record


# ---- the run ----------------------------------------------------------------------------------------------
async def run_requests(
    client: openai.AsyncOpenAI,
    backend: str,
    model: str,
    specs: list[RequestSpec],
    request_rate: float,
    max_concurrency: int | None,
    rng: random.Random,
    progress: tqdm | None = None,
) -> list[RequestRecord]:
    """Send `specs` with Poisson arrivals at `request_rate` (inf: all at once), at most `max_concurrency` open."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(spec: RequestSpec) -> RequestRecord:
        async with limit:
            record = await send_request(client, backend, model, spec)
        if progress is not None:
            progress.update(1)
        return record

    tasks = []
    for i, spec in enumerate(specs):
        tasks.append(asyncio.create_task(one(spec)))
        if math.isfinite(request_rate) and i + 1 < len(specs):
            await asyncio.sleep(rng.expovariate(request_rate))  # exponential gaps: a Poisson process
    return list(await asyncio.gather(*tasks))


# ---- metrics ----------------------------------------------------------------------------------------------
def latency_stats(values_s: list[float]) -> LatencyStats | None:
    """Mean, p50, p90 and p99 (linear interpolation) in ms; None without values."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
    return LatencyStats(mean=float(ms.mean()), p50=p50, p90=p90, p99=p99)


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first; None when there is no second token to time."""
    if not record.success or record.output_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def compute_metrics(records: list[RequestRecord], duration_s: float) -> BenchmarkMetrics:
    """Aggregate the records of one timed run that lasted `duration_s`."""
    done = [r for r in records if r.success]
    input_tokens = sum(r.input_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in map(tpot_s, done) if t is not None]
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        total_throughput=(input_tokens + output_tokens) / duration_s,
        mean_concurrency=sum(r.e2e_s for r in done) / duration_s,
        ttft_ms=latency_stats([r.ttft_s for r in done]),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats([gap for r in done for gap in r.itl_s]),
        e2e_ms=latency_stats([r.e2e_s for r in done]),
    )


# ---- reporting --------------------------------------------------------------------------------------------
def format_summary(metrics: BenchmarkMetrics, backend: str, model: str) -> str:
    """A fixed-width table of the metrics, for the terminal."""
    rows: list[tuple[str, str]] = [
        ("Backend", backend),
        ("Model", model),
        ("Successful requests", str(metrics.completed)),
        ("Failed requests", str(metrics.failed)),
        ("Duration (s)", f"{metrics.duration_s:.2f}"),
        ("Total input tokens", str(metrics.total_input_tokens)),
        ("Total output tokens", str(metrics.total_output_tokens)),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Input token throughput (tok/s)", f"{metrics.input_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics.total_throughput:.2f}"),
        ("Mean concurrency", f"{metrics.mean_concurrency:.2f}"),
    ]
    latencies = {"TTFT": metrics.ttft_ms, "TPOT": metrics.tpot_ms, "ITL": metrics.itl_ms, "E2E": metrics.e2e_ms}
    for name, stats in latencies.items():
        rows.append((f"-- {name} (ms)", ""))
        for key in ("mean", "p50", "p90", "p99"):
            rows.append((f"   {key}", "n/a" if stats is None else f"{getattr(stats, key):.2f}"))
    width = 52
    lines = [" Serving benchmark ".center(width, "=")]
    lines += [f"{label:<36}{value:>16}" for label, value in rows]
    lines.append("=" * width)
    return "\n".join(lines)


def write_plot(records: list[RequestRecord], metrics: BenchmarkMetrics, path: Path, title: str) -> None:
    """CDFs of TTFT, TPOT, ITL and E2E latency in one PNG; throughput in the title."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and touches no pyplot state

    done = [r for r in records if r.success]
    panels = {
        "TTFT": [r.ttft_s for r in done],
        "TPOT": [t for t in map(tpot_s, done) if t is not None],
        "ITL": [gap for r in done for gap in r.itl_s],
        "E2E latency": [r.e2e_s for r in done],
    }
    fig = Figure(figsize=(11, 8), layout="constrained")
    for ax, (name, values) in zip(fig.subplots(2, 2).flat, panels.items()):
        ms = np.sort(np.asarray(values, dtype=float) * 1000.0)
        if len(ms):  # the curve starts at 0 below the smallest sample
            ax.step(np.r_[ms[0], ms], np.arange(len(ms) + 1) / len(ms), where="post")
        stats = latency_stats(values)
        if stats is not None:
            ax.axvline(stats.p50, color="gray", linestyle="--", label=f"p50 {stats.p50:.1f} ms")
            ax.axvline(stats.p99, color="red", linestyle=":", label=f"p99 {stats.p99:.1f} ms")
            ax.legend(loc="lower right")
        ax.set(title=f"{name} ({len(ms)} samples)", xlabel="ms", ylabel="fraction ≤ x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{title}\n{metrics.completed} ok / {metrics.failed} failed in {metrics.duration_s:.1f} s: "
        f"{metrics.request_throughput:.2f} req/s, {metrics.output_throughput:.1f} out tok/s, "
        f"{metrics.total_throughput:.1f} total tok/s"
    )
    fig.savefig(path, dpi=100)


# ---- server discovery -------------------------------------------------------------------------------------
def first_model(base_url: str) -> tuple[str, str | None]:
    """The first model the server lists: its id and (vLLM/SGLang/srt's `root`) its path."""
    cards = httpx.get(f"{base_url}/v1/models", timeout=30).raise_for_status().json()["data"]
    return cards[0]["id"], cards[0].get("root")


def server_vocab_size(base_url: str) -> int:
    """The vocabulary size srt reports in /server_info; other servers need --vocab-size."""
    try:
        return int(httpx.get(f"{base_url}/server_info", timeout=30).raise_for_status().json()["model"]["vocab_size"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
        message = f"cannot read the vocabulary size from {base_url}/server_info ({error}); pass --vocab-size"
        raise SystemExit(message) from None


# ---- CLI --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:30000", help="The server, without /v1.")
    add("--backend", choices=["completions", "chat"], default="completions", help="The OpenAI endpoint to load.")
    add("--model", help="Model name to send (default: the first id of GET /v1/models).")
    add("--tokenizer", help="Tokenizer for --backend chat (default: the model path /v1/models reports).")
    add("--vocab-size", type=int, help="Token ids are drawn from [3, vocab-size) (default: /server_info).")
    add("--num-prompts", type=int, default=100, help="Timed requests.")
    add("--random-input-len", type=int, default=1024, help="Prompt tokens per request (the maximum).")
    add("--random-output-len", type=int, default=128, help="Output tokens per request (the maximum).")
    add("--random-range-ratio", type=float, default=1.0, help="Lengths are uniform in [ratio * len, len].")
    add("--seed", type=int, default=0, help="Seeds the prompts and the arrival times.")
    add("--request-rate", type=float, default=math.inf, help="Requests/s, Poisson arrivals (inf: all at once).")
    add("--max-concurrency", type=int, help="At most this many requests open at once.")
    add("--warmup-requests", type=int, default=0, help="Requests sent (and awaited) before timing; not counted.")
    add("--request-timeout", type=float, default=3600.0, help="Seconds before one request counts as failed.")
    add("--output-json", type=Path, help="Write config, metrics and per-request records here.")
    add("--plot", type=Path, help="Write latency CDFs here (PNG; needs matplotlib).")
    add("--disable-tqdm", action="store_true", help="No progress bar.")
    args = parser.parse_args(argv)
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error("--random-range-ratio must be in [0, 1]")
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        parser.error("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        parser.error("--request-rate must be > 0 and --max-concurrency >= 1")
    return args


def build_requests(
    args: argparse.Namespace, vocab_size: int, tokenizer: str | None
) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(timed, warmup) requests; the timed ones are drawn first so --warmup-requests does not change them."""
    rng = random.Random(args.seed)
    lens = (args.random_input_len, args.random_output_len, args.random_range_ratio, vocab_size, rng)
    timed = random_requests(args.num_prompts, *lens)
    warmup = random_requests(args.warmup_requests, *lens)
    if args.backend == "chat":
        if tokenizer is None:
            raise SystemExit("--backend chat needs --tokenizer (the server reports no model path)")
        timed, warmup = as_chat_text(timed, tokenizer), as_chat_text(warmup, tokenizer)
    return timed, warmup


async def benchmark(
    args: argparse.Namespace, model: str, timed: list[RequestSpec], warmup: list[RequestSpec]
) -> tuple[list[RequestRecord], float]:
    """Warm up, then run the timed requests; their records and the run's duration in seconds."""
    # One connection per request that may be open at once: the client's default pool (1000) would otherwise
    # queue requests on the client and count the wait as TTFT.
    connections = args.max_concurrency or max(len(timed), len(warmup))
    client = openai.AsyncOpenAI(
        base_url=f"{args.base_url}/v1",
        api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        max_retries=0,
        timeout=args.request_timeout,
        http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=connections)),
    )
    arrivals = random.Random(args.seed + 1)  # its own stream: the arrival times do not depend on the prompts
    async with client:
        if warmup:
            print(f"Warming up with {len(warmup)} requests ...", file=sys.stderr)
            records = await run_requests(client, args.backend, model, warmup, math.inf, args.max_concurrency, arrivals)
            failed = [r.error for r in records if not r.success]
            if failed:
                raise SystemExit(f"{len(failed)} warmup request(s) failed, e.g. {failed[0]}")
        with tqdm(total=len(timed), disable=args.disable_tqdm, desc="requests") as progress:
            start = time.perf_counter()
            records = await run_requests(
                client, args.backend, model, timed, args.request_rate, args.max_concurrency, arrivals, progress
            )
            duration = time.perf_counter() - start
    return records, duration


def main(argv: list[str] | None = None) -> BenchmarkMetrics:
    """Run the benchmark the command line describes; print the summary and write the requested files."""
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    listed, root = first_model(args.base_url)
    model = args.model or listed
    vocab_size = args.vocab_size or server_vocab_size(args.base_url)
    timed, warmup = build_requests(args, vocab_size, args.tokenizer or root)
    records, duration = asyncio.run(benchmark(args, model, timed, warmup))
    metrics = compute_metrics(records, duration)

    print(format_summary(metrics, args.backend, model))
    errors = [r.error for r in records if not r.success]
    for error in errors[:3]:
        print(f"failed: {error}", file=sys.stderr)
    if args.output_json:
        config = {**{k: _jsonable(v) for k, v in vars(args).items()}, "model": model, "vocab_size": vocab_size}
        report = {"config": config, "metrics": asdict(metrics), "requests": [asdict(r) for r in records]}
        args.output_json.write_text(json.dumps(report, indent=2, allow_nan=False))
    if args.plot:
        write_plot(records, metrics, args.plot, f"{args.backend} · {model}")
    return metrics


def _jsonable(value: object) -> object:
    """Paths as strings and inf (the default request rate) as "inf": strict JSON has no Infinity."""
    if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
        return str(value)
    return value


if __name__ == "__main__":
    sys.exit(0 if main().completed else 1)
