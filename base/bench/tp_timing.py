"""Latency under tensor parallelism: `bench_one_batch.py --tp-size N` runs here.

One process per rank (spawned, each on GPU base + rank, joined over torch.distributed as the server's ranks
are); every rank runs the same batches in lockstep (their collectives pair up) and rank 0 reports: prefill and
decode-step times per batch size, its KV pool (tokens per rank), the time of one all-reduce of a decode step's
o / down output (float32 [batch, hidden], the message `reduce_sum` sends; two per layer, three on MoE layers)
launched eagerly on its own, and, on GPUs, from a torch.profiler trace of graphed decode steps, the device time
per step of the all-reduce kernels beside that of all kernels. Floors are not computed: bench/floors.py counts
one device's bytes and FLOPs.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import time
from pathlib import Path

import torch
import torch.distributed as dist
from batch_fit import BatchNeed, check_runner, kv_pools

from srt.distributed.placement import RankPlace, free_loopback_address
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs

ALL_REDUCE_ITERS = 200
PROFILED_DECODE_STEPS = 8


def run_tp_latency(
    server_args: ServerArgs,
    batches: list[list[list[int]]],
    output_len: int,
    needs: list[BatchNeed],
    json_path: Path | None,
) -> None:
    """Spawn the ranks, wait for them; rank 0 prints the figures and writes `json_path`."""
    if server_args.dist_init_addr is None:
        server_args = dataclasses.replace(server_args, dist_init_addr=free_loopback_address())
    ctx = mp.get_context("spawn")
    size = server_args.tp_size
    procs = [
        ctx.Process(target=_rank_main, args=(server_args, RankPlace(r, size, r), batches, output_len, needs, json_path))
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [r for r, proc in enumerate(procs) if proc.exitcode]
    if failed:
        raise SystemExit(f"tensor-parallel ranks {failed} failed (their tracebacks are above)")


def _rank_main(
    server_args: ServerArgs,
    place: RankPlace,
    batches: list[list[list[int]]],
    output_len: int,
    needs: list[BatchNeed],
    json_path: Path | None,
) -> None:
    from bench_one_batch import run_latency  # the same timing loop as one rank's

    from srt.distributed.ranks import TensorParallelGroup

    group = TensorParallelGroup(server_args, place)
    try:
        runner = ModelRunner(server_args, tp=group)
        check_runner(runner, needs)
        latency = run_latency(runner, batches, output_len)
        hidden = runner.model_config.hidden_size
        reduce_us = {bs: all_reduce_us(bs, hidden, runner.device) for bs in sorted({len(b) for b in batches})}
        profiled = {len(b): decode_kernel_us(runner, b) for b in batches} if runner.device.type == "cuda" else {}
        if place.is_first:
            output = {
                **latency.output,
                "tp_size": place.size,
                "kv_pools_per_rank": kv_pools(runner),
                "all_reduce_us": reduce_us,
                "decode_step_kernels_us": profiled,
            }
            print_tp(output)
            if json_path is not None:
                json_path.write_text(json.dumps(output))
    finally:
        group.close()


def all_reduce_us(rows: int, hidden: int, device: torch.device) -> float:
    """Microseconds of one all-reduce of a float32 [rows, hidden] tensor (a decode step's o / down sum),
    launched eagerly back to back."""
    tensor = torch.zeros(rows, hidden, dtype=torch.float32, device=device)  # sums stay finite
    for _ in range(10):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(ALL_REDUCE_ITERS):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / ALL_REDUCE_ITERS * 1e6


def decode_kernel_us(runner: ModelRunner, prompts: list[list[int]]) -> dict[str, float]:
    """Device microseconds per decode step of the all-reduce kernels and of all kernels, and all-reduce kernels
    per step, from a torch.profiler trace of PROFILED_DECODE_STEPS decode steps of `prompts` (the profiler starts
    after the prefill, which generate_greedy reads before step 1)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def start_after_prefill(step: int) -> None:
        if step == 1:
            prof.start()

    generate_greedy(runner, prompts, 1 + PROFILED_DECODE_STEPS, keep_logits=False, before_step=start_after_prefill)
    torch.cuda.synchronize(runner.device)
    prof.stop()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    reduces = [e for e in kernels if "allreduce" in e.name.replace("_", "").lower()]
    return {
        "all_reduce": sum(e.device_time for e in reduces) / PROFILED_DECODE_STEPS,
        "all_reduce_kernels": len(reduces) / PROFILED_DECODE_STEPS,
        "all_kernels": sum(e.device_time for e in kernels) / PROFILED_DECODE_STEPS,
    }


def print_tp(output: dict) -> None:
    pools = output["kv_pools_per_rank"]
    print(f"TP={output['tp_size']}: KV pools per rank: full {pools['full_tokens']} tokens, swa {pools['swa_tokens']}")
    for row in output["results"]:
        print(
            f"batch {row['batch_size']:4d} x {row['input_len']} tokens: prefill {row['prefill_s'] * 1e3:9.1f} ms"
            f" ({row['prefill_tok_per_s']:10.0f} tok/s), decode {row['decode_step_s'] * 1e3:8.2f} ms/step"
            f" ({row['decode_tok_per_s']:8.0f} tok/s)"
        )
    for rows, micros in output["all_reduce_us"].items():
        print(f"all-reduce float32 [{rows}, hidden], eager: {micros:.1f} us (2 per layer, 3 on MoE layers)")
    for rows, micros in output["decode_step_kernels_us"].items():
        print(
            f"decode step of batch {rows} (profiled): {micros['all_reduce_kernels']:.0f} all-reduce kernels, "
            f"{micros['all_reduce']:.0f} us of {micros['all_kernels']:.0f} us of kernels"
        )
