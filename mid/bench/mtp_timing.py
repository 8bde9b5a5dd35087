"""bench_one_batch's speculative mode (--speculative-draft-model-path): plain decode vs MTP, on one runner.

For each batch size, the same random prompts are decoded by the scheduler twice, first with drafting off
(plain decode steps, CUDA graphs, overlap schedule), then with the assistant (draft rounds + verify steps).
Reported per batch size:
    plain decode step, draft round, verify step   GPU time per call (CUDA events around each call)
    ms per output token                           decode wall time / tokens per request (after the prefill)
    tokens/s, accept length                       tokens per verify round, from the scheduler's counts
    ideal speedup                                 accept length x decode step / (draft round + verify step)
Random weights accept almost nothing: set SRT_SIMULATE_ACCEPT_LEN (e.g. 2.5) to make verify accept that
many tokens per round on average (outputs change; refused unless --load-format dummy).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

TRACE_TOKENS = 24  # per request in a --trace run: a few verify rounds after the prefill


class CallTimer:
    """GPU time of each call of a function (CUDA events around it), by a label the caller picks per call."""

    def __init__(self) -> None:
        self.pending: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    def wrap(self, fn: Callable, label: Callable[..., str | None]) -> Callable:
        def timed(*args, **kwargs):
            name = label(*args, **kwargs)
            if name is None or not torch.cuda.is_available():
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.pending[name].append((start, end))
            return out

        return timed

    def mean_ms(self, name: str) -> float | None:
        if not torch.cuda.is_available():
            return None
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in self.pending.pop(name, [])]
        return statistics.mean(times) if times else None


def decode_run(scheduler: Scheduler, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """Seconds from the step after every request's first token to the last token."""
    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReq(f"{tag}-{i}", ids, params))
    first_tokens: set[str] = set()
    while len(first_tokens) < len(prompts):
        first_tokens.update(out.rid for out in scheduler.step() if out.new_token_ids)
    start = time.perf_counter()
    while scheduler.has_work():
        scheduler.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_mtp_latency(
    server_args: ServerArgs, batch_sizes: list[int], input_len: int, output_len: int, trace: Path | None = None
) -> dict:
    scheduler = Scheduler(server_args)
    runner, spec = scheduler.runner, scheduler.spec
    rows = spec.num_steps + 1
    timer = CallTimer()
    current = {"batch_size": 0}

    def forward_label(batch) -> str | None:
        if batch.num_tokens == current["batch_size"] and batch.batch_size == current["batch_size"]:
            return "decode"
        if batch.num_tokens == current["batch_size"] * rows and batch.batch_size == current["batch_size"]:
            return "verify"
        return None

    runner.forward = timer.wrap(runner.forward, forward_label)
    runner.draft = timer.wrap(runner.draft, lambda requests: "draft")
    generator = torch.Generator().manual_seed(0)
    results = []
    for batch_size in tqdm(batch_sizes, desc="MTP batch sizes"):
        current["batch_size"] = batch_size
        prompts = torch.randint(3, runner.model_config.vocab_size, (batch_size, input_len), generator=generator)
        row = {"batch_size": batch_size, "input_len": input_len, "output_len": output_len}
        for mode in ("plain", "mtp"):
            scheduler.spec = spec if mode == "mtp" else None
            decode_run(scheduler, prompts[:, :16].tolist(), 4, f"warm-{mode}-{batch_size}")
            for name in ("decode", "verify", "draft"):
                timer.mean_ms(name)  # drop the warm-up's calls
            counts_before = list(spec.accept_counts)
            seconds = decode_run(scheduler, prompts.tolist(), output_len, f"{mode}-{batch_size}")
            tokens = output_len - 1  # per request, after its first (the prefill's)
            row[f"{mode}_ms_per_token"] = seconds / tokens * 1e3
            row[f"{mode}_tokens_per_s"] = batch_size * tokens / seconds
            if mode == "plain":
                row["decode_step_ms"] = timer.mean_ms("decode")
            else:
                row["draft_round_ms"], row["verify_step_ms"] = timer.mean_ms("draft"), timer.mean_ms("verify")
                rounds = [a - b for a, b in zip(spec.accept_counts, counts_before, strict=True)]
                row["accept_length"] = sum((n + 1) * r for n, r in enumerate(rounds)) / max(1, sum(rounds))
        row["speedup"] = row["plain_ms_per_token"] / row["mtp_ms_per_token"]
        if row["decode_step_ms"] and row["draft_round_ms"] and row["verify_step_ms"]:
            round_ms = row["draft_round_ms"] + row["verify_step_ms"]
            row["ideal_speedup"] = row["accept_length"] * row["decode_step_ms"] / round_ms
        results.append(row)
        scheduler.check_integrity()
    if trace is not None:
        prompts = torch.randint(3, runner.model_config.vocab_size, (batch_sizes[0], input_len), generator=generator)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        for mode in ("plain", "mtp"):
            scheduler.spec = spec if mode == "mtp" else None
            with profile(activities=activities) as prof:
                decode_run(scheduler, prompts.tolist(), TRACE_TOKENS, f"trace-{mode}")
            prof.export_chrome_trace(str(trace.with_name(f"{trace.stem}-{mode}.json")))
        scheduler.spec = spec
    return {"device": str(runner.device), "num_steps": spec.num_steps, "mtp": results}


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if row.get(key) is not None else "n/a"


def print_mtp(output: dict) -> None:
    for row in output["mtp"]:
        ms = lambda key: _ms(row, key)  # noqa: B023 - used at once, in this iteration
        print(
            f"batch {row['batch_size']:3d}: decode step {ms('decode_step_ms')} ms, draft round ({output['num_steps']}"
            f" steps) {ms('draft_round_ms')} ms, verify step {ms('verify_step_ms')} ms | per output token: plain"
            f" {row['plain_ms_per_token']:.3f} ms, MTP {row['mtp_ms_per_token']:.3f} ms (accept length"
            f" {row['accept_length']:.2f}) | {row['plain_tokens_per_s']:.0f} -> {row['mtp_tokens_per_s']:.0f} tok/s,"
            f" speedup {row['speedup']:.2f}x (ideal {row.get('ideal_speedup') or float('nan'):.2f}x)"
        )
