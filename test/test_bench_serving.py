"""`bench/bench_serving.py`: its metric arithmetic by hand, and a real run against a tiny server on loopback.

The end-to-end run is checked against what the server itself reports: the tokens it generated
(/server_info's generated_tokens_total) and the prompt lengths it saw (usage), not against the script's own
bookkeeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from serving_fixtures import PRESET, wait_idle

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "bench_serving.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_bench():
    # bench/ first on sys.path, as `python bench/bench_serving.py` has it: its sibling modules import by name
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _load_sibling(name: str):
    """A module of bench/ by name, as bench_serving imports it (bench/ is on sys.path by now)."""
    return importlib.import_module(name)


# ---- pure functions ---------------------------------------------------------------------------------------
def test_latency_stats_are_ms_percentiles_by_linear_interpolation() -> None:
    stats = bench.latency_stats([k / 1000 for k in range(1, 101)])  # 1..100 ms
    assert stats.mean == pytest.approx(50.5)
    assert (stats.p50, stats.p90, stats.p99) == pytest.approx((50.5, 90.1, 99.01))

    rng = random.Random(3)
    values = [rng.expovariate(20.0) for _ in range(37)]
    cuts = statistics.quantiles([v * 1000 for v in values], n=100, method="inclusive")  # cuts[i]: p(i+1)
    stats = bench.latency_stats(values)
    assert (stats.p50, stats.p90, stats.p99) == pytest.approx((cuts[49], cuts[89], cuts[98]))
    assert stats.mean == pytest.approx(statistics.fmean(values) * 1000)
    assert bench.latency_stats([]) is None


def test_tpot_needs_a_second_token() -> None:
    one = bench.RequestRecord(16, 1, success=True, output_tokens=1, ttft_s=0.2, e2e_s=0.2)
    five = bench.RequestRecord(16, 5, success=True, output_tokens=5, ttft_s=0.2, e2e_s=0.6)
    failed = bench.RequestRecord(16, 5, error="boom")
    assert bench.tpot_s(one) is None
    assert bench.tpot_s(five) == pytest.approx(0.1)  # 4 tokens after the first in 0.4 s
    assert bench.tpot_s(failed) is None


def test_compute_metrics_counts_only_completed_requests() -> None:
    records = [
        bench.RequestRecord(10, 1, success=True, output_tokens=1, ttft_s=0.1, e2e_s=0.1),
        bench.RequestRecord(20, 3, success=True, output_tokens=3, ttft_s=0.2, e2e_s=0.6, itl_s=[0.1, 0.3]),
        bench.RequestRecord(30, 3, error="boom"),
    ]
    metrics = bench.compute_metrics(records, duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (30, 4)
    assert metrics.request_throughput == pytest.approx(1.0)
    assert (metrics.input_throughput, metrics.output_throughput, metrics.total_throughput) == pytest.approx(
        (15.0, 2.0, 17.0)
    )
    assert metrics.mean_concurrency == pytest.approx(0.35)
    assert metrics.tpot_ms.mean == pytest.approx(200.0)  # only the 3-token request has a TPOT
    assert metrics.itl_ms.mean == pytest.approx(200.0) and metrics.itl_ms.p50 == pytest.approx(200.0)
    assert metrics.ttft_ms.mean == pytest.approx(150.0) and metrics.e2e_ms.mean == pytest.approx(350.0)


def test_arrival_timings_split_a_chunk_of_several_tokens_into_equal_gaps() -> None:
    ttft, gaps = bench.arrival_timings(0.8, [(1.0, 2), (1.5, 1), (2.1, 3)])
    assert ttft == pytest.approx(0.2)  # the first chunk's second token adds no gap: nothing times it apart
    assert gaps == pytest.approx([0.5, 0.2, 0.2, 0.2])
    assert bench.arrival_timings(0.0, [(0.3, 1)]) == (pytest.approx(0.3), [])


def test_emit_timings_time_the_server_and_each_stage() -> None:
    def chunk(scheduler: float, tokens: int = 1) -> tuple[dict, int]:
        # detokenizer +1 ms, tokenizer manager +2 ms, SSE write +4 ms, client +8 ms after the scheduler
        stages = [scheduler, scheduler + 0.001, scheduler + 0.003, scheduler + 0.007, scheduler + 0.015]
        return dict(zip(bench.EMIT_STAGES, stages)), tokens

    server_itl, lag = bench.emit_timings([chunk(10.0), chunk(10.006), chunk(10.018, tokens=2)])
    assert server_itl == pytest.approx([0.006, 0.006, 0.006])  # a chunk of 2 tokens: 2 equal gaps
    want = {"detokenizer": 0.001, "tokenizer_manager": 0.002, "sse": 0.004, "client": 0.008}
    assert list(lag) == list(want) and all(lag[stage] == pytest.approx([want[stage]] * 3) for stage in want)

    timed = bench.RequestRecord(
        8, 4, success=True, output_tokens=4, ttft_s=0.1, e2e_s=0.12, itl_s=[0.0002, 0.0002, 0.02],
        server_itl_s=server_itl, emit_lag_s=lag,
    )  # fmt: skip
    untimed = bench.RequestRecord(8, 4, success=True, output_tokens=4, ttft_s=0.1, e2e_s=1)  # a server without it
    metrics = bench.compute_metrics([timed, untimed], 1.0)
    assert metrics.server_itl_ms.p50 == pytest.approx(6.0) and metrics.itl_ms.p50 == pytest.approx(0.2)
    assert metrics.emit_lag_ms["client"].p50 == pytest.approx(8.0) and list(metrics.emit_lag_ms) == list(lag)
    assert bench.metrics_from_json(json.loads(json.dumps(dataclasses.asdict(metrics)))) == metrics
    assert "Server ITL" in bench.format_summary(metrics, "completions", "m")
    plain = bench.compute_metrics([bench.RequestRecord(8, 4, success=True, output_tokens=1, ttft_s=0.1, e2e_s=1)], 1)
    assert plain.server_itl_ms is None and plain.emit_lag_ms is None
    assert "Server ITL" not in bench.format_summary(plain, "completions", "m")


def test_client_processes_share_requests_and_the_concurrency_limit() -> None:
    clients = _load_sibling("serving_clients")
    specs = bench.random_requests(10, 4, 4, 1.0, 50, random.Random(0))
    whole = clients.Job("http://x", "completions", "m", 1.0, False, False, specs, [0.1 * i for i in range(10)], 7)
    jobs = clients.split(whole, 3)
    assert [job.concurrency for job in jobs] == [3, 2, 2]  # shares of the limit add up to it
    assert [job.specs for job in jobs] == [specs[0::3], specs[1::3], specs[2::3]]  # request i to process i % 3
    assert jobs[1].send_at == pytest.approx([0.1, 0.4, 0.7])  # each request keeps its arrival time
    assert len(clients.split(whole, 16)) == 7  # never more processes than slots...
    assert len(clients.split(replace(whole, concurrency=None, specs=specs[:2]), 4)) == 2  # ...or requests
    assert [job.concurrency for job in clients.split(replace(whole, concurrency=None), 2)] == [None, None]

    results = [clients.JobResult([("record", i) for i in range(k, 10, 3)], 0.0) for k in range(3)]
    assert clients.merge(whole, jobs, results) == [("record", i) for i in range(10)]  # request order again
    assert clients.default_process_count(32, 128) == min(4, max(1, (os.cpu_count() or 2) // 2))


def test_client_processes_stop_at_the_deadline() -> None:
    """A server that accepts connections and never answers: the run ends at its deadline with
    asyncio.TimeoutError (what serving_ab's --time-limit relies on), its processes stopped."""
    clients = _load_sibling("serving_clients")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        specs = bench.random_requests(4, 4, 2, 1.0, 50, random.Random(0))
        job = clients.Job(url, "completions", "m", 60.0, False, False, specs, [0.0] * 4, 4)
        with clients.ClientProcesses(2) as processes:
            with pytest.raises(asyncio.TimeoutError):
                processes.run(job, deadline=time.monotonic() + 1.0)
            assert not any(proc.is_alive() for proc in processes.procs)


def test_arrival_offsets_are_poisson_and_seeded() -> None:
    assert bench.arrival_offsets(4, math.inf, random.Random(0)) == [0.0] * 4
    offsets = bench.arrival_offsets(2000, 50.0, random.Random(1))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and min(gaps) > 0 and statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.1)
    rng = random.Random(1)
    assert gaps[:3] == pytest.approx([rng.expovariate(50.0) for _ in range(3)])  # one draw per gap, in order


def test_workloads_set_lengths_and_runs_and_explicit_flags_win() -> None:
    Run = bench.Run
    args = bench.parse_args(["--workload", "fast-prefill"])
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (8192, 150, 1.0)
    assert args.runs == [Run(8, 32, 8), Run(32, 128, 8)]
    assert bench.parse_args(["--workload", "yoco-30x7000"]).runs == [Run(30, 30, 2)]
    for name, lens in (("chat", (1000, 1000)), ("summarize", (8000, 1000))):
        args = bench.parse_args(["--workload", name])
        assert (args.random_input_len, args.random_output_len) == lens and args.runs == [Run(32, 128, 8)]

    args = bench.parse_args(["--workload", "fast-prefill", "--max-concurrency", "16", "--random-input-len", "100"])
    assert args.runs == [Run(16, 64, 8)] and (args.random_input_len, args.random_output_len) == (100, 150)
    args = bench.parse_args(["--workload", "fast-prefill", "--num-prompts", "5", "--warmup-requests", "0"])
    assert args.runs == [Run(8, 5, 0), Run(32, 5, 0)]

    mm = bench.parse_args(["--workload", "random-mm"])  # the published image shape, through chat
    assert (mm.random_input_len, mm.random_output_len, mm.runs) == (50, 10, [Run(32, 128, 8)])
    assert (mm.backend, mm.random_image_count, mm.random_image_size) == ("chat", 6, (480, 480))
    mm = bench.parse_args(["--workload", "random-mm", "--random-image-count", "2", "--random-image-size", "64x48"])
    assert (mm.random_image_count, mm.random_image_size) == (2, (64, 48))

    plain = bench.parse_args([])  # no workload: the flags' defaults, one run without a concurrency limit
    assert (plain.random_input_len, plain.random_output_len, plain.runs) == (1024, 128, [Run(None, 100, 0)])
    assert (plain.backend, plain.random_image_count) == ("completions", 0)
    for bad in (["--random-image-count", "2"], ["--backend", "chat", "--random-image-size", "48"]):
        with pytest.raises(SystemExit):  # images need chat; a size is WIDTHxHEIGHT
            bench.parse_args(bad)
    assert bench.run_paths(Path("out.json"), Run(8, 32, 8), args.runs) == Path("out-c8.json")
    assert bench.run_paths(Path("out.json"), plain.runs[0], plain.runs) == Path("out.json")
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "no-such-workload"])


def test_random_requests_lengths_and_ids() -> None:
    exact = bench.random_requests(5, 16, 4, 1.0, 50, random.Random(0))
    assert [(len(s.prompt), s.input_len, s.output_len) for s in exact] == [(16, 16, 4)] * 5
    assert all(3 <= tok < 50 for s in exact for tok in s.prompt)
    assert exact == bench.random_requests(5, 16, 4, 1.0, 50, random.Random(0))  # seeded
    varied = bench.random_requests(200, 100, 10, 0.5, 50, random.Random(1))
    assert {s.input_len for s in varied} <= set(range(50, 101)) and len({s.input_len for s in varied}) > 20
    assert {s.output_len for s in varied} == set(range(5, 11))
    assert all(len(s.prompt) == s.input_len for s in varied)


# ---- against a server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's server (conftest.py); this module leaves it idle with no slot leaked."""
    yield shared_server
    wait_idle(shared_server.url)


def generated_total(url: str) -> int:
    return httpx.get(f"{url}/server_info", timeout=30).json()["generated_tokens_total"]


def run_bench(url: str, out: Path, *args: str) -> dict:
    command = [sys.executable, str(SCRIPT), "--base-url", url, "--output-json", str(out), "--disable-tqdm", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Output token throughput" in done.stdout and "Output tokens per chunk" in done.stdout
    return {"stderr": done.stderr, **json.loads(out.read_text())} if out.exists() else {"stderr": done.stderr}


def test_completions_run_sends_exact_lengths_and_reports_every_metric(server, model, tmp_path) -> None:
    before = generated_total(server.url)
    plot = tmp_path / "bench.png"
    report = run_bench(
        server.url, tmp_path / "bench.json", "--num-prompts", "4", "--random-input-len", "16",
        "--random-output-len", "4", "--warmup-requests", "1", "--max-concurrency", "2", "--plot", str(plot),
    )  # fmt: skip
    # 4 timed requests and 1 warmup, each generating exactly 4 tokens (ignore_eos)
    assert generated_total(server.url) - before == 5 * 4

    metrics = report["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (4, 0)
    assert metrics["total_output_tokens"] == 16 and metrics["total_input_tokens"] == 4 * 16
    for record in report["requests"]:
        assert record["success"] and record["input_len"] == 16 and record["output_tokens"] == 4  # server's usage
        assert 0 < record["ttft_s"] <= record["e2e_s"] and 1 <= len(record["itl_s"]) <= 3
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = metrics[name]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], name
    assert metrics["output_throughput"] == pytest.approx(16 / metrics["duration_s"])
    assert metrics["mean_concurrency"] <= 2 + 1e-9  # --max-concurrency 2: never more than 2 requests open
    assert report["config"]["model"] == str(model)  # the server's default served name: the checkpoint path
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_emit_timestamps_run_reports_where_tokens_wait(server, tmp_path) -> None:
    report = run_bench(
        server.url, tmp_path / "emit.json", "--num-prompts", "3", "--random-input-len", "16",
        "--random-output-len", "5", "--max-concurrency", "3", "--emit-timestamps",
    )  # fmt: skip
    metrics = report["metrics"]
    assert metrics["completed"] == 3 and metrics["server_itl_ms"]["p50"] > 0
    assert list(metrics["emit_lag_ms"]) == ["detokenizer", "tokenizer_manager", "sse", "client"]
    for record in report["requests"]:
        chunks = record["chunks"]
        assert len(record["server_itl_s"]) == len(record["itl_s"]) == chunks - 1  # a gap between two chunks
        assert all(len(lags) == chunks and min(lags) >= 0 for lags in record["emit_lag_s"].values())
        # the send and the first chunk's stamps in wall-clock time, for bench/step_trace.py --requests
        stamps = record["first_emit_ts"]
        assert record["sent_at"] < stamps["scheduler"] <= stamps["client"]
        assert stamps["client"] == pytest.approx(record["sent_at"] + record["ttft_s"], abs=0.05)


def test_run_from_two_client_processes(server, tmp_path) -> None:
    """Requests spread over two client processes come back in request order with their own lengths, and the
    two processes never have more requests open than the limit."""
    before = generated_total(server.url)
    report = run_bench(
        server.url, tmp_path / "two.json", "--num-prompts", "6", "--random-input-len", "12",
        "--random-output-len", "6", "--random-range-ratio", "0.3", "--max-concurrency", "3",
        "--client-processes", "2", "--warmup-requests", "2", "--request-rate", "40",
    )  # fmt: skip
    vocab = report["config"]["vocab_size"]
    rng = random.Random(0)  # what the script drew (seed 0): the timed requests, then the warm-up ones
    specs, warmup = bench.random_requests(6, 12, 6, 0.3, vocab, rng), bench.random_requests(2, 12, 6, 0.3, vocab, rng)
    records = report["requests"]
    assert [(r["input_len"], r["output_tokens"]) for r in records] == [(s.input_len, s.output_len) for s in specs]
    assert generated_total(server.url) - before == sum(s.output_len for s in specs + warmup)
    metrics = report["metrics"]
    assert metrics["completed"] == 6 and metrics["mean_concurrency"] <= 3 + 1e-9
    assert metrics["output_throughput"] == pytest.approx(metrics["total_output_tokens"] / metrics["duration_s"])


def test_chat_run_with_poisson_arrivals(server, tmp_path) -> None:
    report = run_bench(
        server.url, tmp_path / "chat.json", "--backend", "chat", "--num-prompts", "3", "--random-input-len", "24",
        "--random-output-len", "3", "--request-rate", "50",
    )  # fmt: skip
    metrics = report["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (3, 0, 9)
    assert all(r["input_len"] > 0 for r in report["requests"])  # the templated prompt, as the server counted it


def test_workload_runs_with_tokens_counted_by_logprobs(server, tmp_path) -> None:
    """`--workload smoke`: two runs (concurrency 2 with 4 prompts, 4 with 8; one warm-up each), each to its own
    JSON. With --stream-logprobs every token is timed, including tokens whose text the server holds back."""
    before = generated_total(server.url)
    report = run_bench(server.url, tmp_path / "smoke.json", "--workload", "smoke", "--stream-logprobs")
    assert "defined with the radix cache off" in report["stderr"]  # this server runs with it on
    assert generated_total(server.url) - before == (4 + 1 + 8 + 1) * 4
    for concurrency, prompts in ((2, 4), (4, 8)):
        run = json.loads((tmp_path / f"smoke-c{concurrency}.json").read_text())
        assert (run["config"]["max_concurrency"], run["config"]["num_prompts"]) == (concurrency, prompts)
        metrics = run["metrics"]
        counts = (metrics["completed"], metrics["total_output_tokens"], metrics["tokens_per_chunk"])
        assert counts == (prompts, 4 * prompts, 1.0)
        for record in run["requests"]:
            assert record["input_len"] == 32 and record["output_tokens"] == record["chunks"] == 4
            assert len(record["itl_s"]) == 3
