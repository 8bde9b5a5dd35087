"""What `bench_serving.py` measures per request, and the aggregate metrics, table and plot of one run.

Definitions (as vLLM's and SGLang's bench_serving define them), all timed on the client:
    TTFT   time from sending the request to the first streamed chunk that carries output
    ITL    every gap between two consecutive token arrivals of one request
    TPOT   (E2E - TTFT) / (output_tokens - 1), per request; undefined for one output token
    E2E    time from sending the request to the end of its stream
A chunk is one token arrival unless the request asked for logprobs (`--stream-logprobs`): then a chunk that
carries n tokens (its logprob entries) adds n gaps of (time since the previous chunk) / n to ITL, as SGLang's
client does.

With `--emit-timestamps` srt stamps each streamed chunk with when its step's tokens left each serving process
(`emit_ts`, wall-clock seconds), and two more figures say where tokens wait:
    server ITL   ITL timed by the scheduler's emit times: what clients would see if nothing after the
                 scheduler held tokens back
    emit lag     per stage, per chunk: the time from the stage before it, along
                 scheduler -> detokenizer -> tokenizer_manager -> sse (the chunk written) -> client (parsed)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
# The stages of `emit_ts` in the order a token passes them, then the client's arrival.
EMIT_STAGES = ("scheduler", "detokenizer", "tokenizer_manager", "sse", "client")


@dataclass
class RequestRecord:
    """What one request measured on the client (seconds since it was sent)."""

    input_len: int  # the server's prompt_tokens when it reports usage, else the prompt's length
    output_len: int  # requested
    success: bool = False
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried output
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    server_itl_s: list[float] = field(default_factory=list)  # with --emit-timestamps (module docstring)
    emit_lag_s: dict[str, list[float]] = field(default_factory=dict)  # stage -> one lag per chunk
    sent_at: float | None = None  # wall clock (time.time()) when it was sent: beside a server's step trace
    first_emit_ts: dict[str, float] = field(default_factory=dict)  # --emit-timestamps: the first chunk's, client's too


def arrival_timings(start: float, arrivals: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """(TTFT, ITL gaps) from chunk arrivals (time, tokens in the chunk), the first of which is the first token.

    Tokens after the first one in the first chunk add no gap: nothing times them apart from it.
    """
    ttft = arrivals[0][0] - start
    gaps = []
    for (before, _), (now, tokens) in zip(arrivals, arrivals[1:]):
        gaps += [(now - before) / tokens] * tokens
    return ttft, gaps


def emit_timings(chunks: list[tuple[dict[str, float], int]]) -> tuple[list[float], dict[str, list[float]]]:
    """(server ITL gaps, emit lag per stage) of one request from its output chunks: (the chunk's `emit_ts` with
    "client", its wall-clock arrival, added; tokens in the chunk). Gaps split as `arrival_timings` splits them."""
    _, server_itl = arrival_timings(0.0, [(times["scheduler"], tokens) for times, tokens in chunks])
    lag = {
        stage: [times[stage] - times[before] for times, _ in chunks]
        for before, stage in zip(EMIT_STAGES, EMIT_STAGES[1:])
    }
    return server_itl, lag


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
    tokens_per_chunk: float | None  # output tokens / output chunks; 1.0 when every token streamed alone
    ttft_ms: LatencyStats | None
    tpot_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None
    server_itl_ms: LatencyStats | None = None  # with --emit-timestamps (module docstring)
    emit_lag_ms: dict[str, LatencyStats] | None = None


def metrics_from_json(data: dict) -> BenchmarkMetrics:
    """`BenchmarkMetrics` back from its `asdict` form (what the JSON reports hold)."""
    stats = {
        key: LatencyStats(**value)
        for key, value in data.items()
        if key.endswith("_ms") and key != "emit_lag_ms" and value is not None
    }
    if data.get("emit_lag_ms") is not None:
        stats["emit_lag_ms"] = {stage: LatencyStats(**value) for stage, value in data["emit_lag_ms"].items()}
    return BenchmarkMetrics(**{**data, **stats})


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
    chunks = sum(r.chunks for r in done)
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
        tokens_per_chunk=output_tokens / chunks if chunks else None,
        ttft_ms=latency_stats([r.ttft_s for r in done]),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats([gap for r in done for gap in r.itl_s]),
        e2e_ms=latency_stats([r.e2e_s for r in done]),
        server_itl_ms=latency_stats([gap for r in done for gap in r.server_itl_s]),
        emit_lag_ms=_emit_lag_stats(done),
    )


def _emit_lag_stats(done: list[RequestRecord]) -> dict[str, LatencyStats] | None:
    stages = [stage for stage in EMIT_STAGES[1:] if any(r.emit_lag_s.get(stage) for r in done)]
    if not stages:
        return None
    return {stage: latency_stats([lag for r in done for lag in r.emit_lag_s.get(stage, [])]) for stage in stages}


def format_summary(metrics: BenchmarkMetrics, backend: str, model: str, title: str = "Serving benchmark") -> str:
    """A fixed-width table of the metrics, for the terminal."""
    per_chunk = "n/a" if metrics.tokens_per_chunk is None else f"{metrics.tokens_per_chunk:.3f}"
    rows: list[tuple[str, str]] = [
        ("Backend", backend),
        ("Model", model),
        ("Successful requests", str(metrics.completed)),
        ("Failed requests", str(metrics.failed)),
        ("Duration (s)", f"{metrics.duration_s:.2f}"),
        ("Total input tokens", str(metrics.total_input_tokens)),
        ("Total output tokens", str(metrics.total_output_tokens)),
        ("Output tokens per chunk", per_chunk),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Input token throughput (tok/s)", f"{metrics.input_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics.total_throughput:.2f}"),
        ("Mean concurrency", f"{metrics.mean_concurrency:.2f}"),
    ]
    latencies = {"TTFT": metrics.ttft_ms, "TPOT": metrics.tpot_ms, "ITL": metrics.itl_ms, "E2E": metrics.e2e_ms}
    if metrics.server_itl_ms is not None:
        latencies["Server ITL"] = metrics.server_itl_ms
    for name, stats in latencies.items():
        rows.append((f"-- {name} (ms)", ""))
        for key in ("mean", "p50", "p90", "p99"):
            rows.append((f"   {key}", "n/a" if stats is None else f"{getattr(stats, key):.2f}"))
    if metrics.emit_lag_ms is not None:
        rows.append(("-- Emit lag, from the stage before", "ms p50 / p99"))
        for stage, stats in metrics.emit_lag_ms.items():
            rows.append((f"   {stage}", f"{stats.p50:.2f} / {stats.p99:.2f}"))
    width = 52
    lines = [f" {title} ".center(width, "=")]
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
