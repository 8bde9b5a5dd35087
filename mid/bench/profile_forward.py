"""Profile one prefill, or the decode steps after it, with torch.profiler; print the top operators.

    python bench/profile_forward.py --model-path gemma-4-E2B-it --load-format dummy --dtype bfloat16 \
        --max-total-tokens 24576 --batch-size 1 --input-len 7000
    python bench/profile_forward.py --model-path gemma-4-E4B-it --load-format dummy --phase decode \
        --batch-size 1 --input-len 512 --disable-cuda-graph

Kernels of a replayed CUDA graph are not listed one by one: profile decode with --disable-cuda-graph to see
them (their GPU times are the same; the host launch times are what the graph removes). With graphs, decode
also prints a step's timeline: the host's forward call, the device's forward and its graph replay, next to
the whole step (argmax and the copy of the ids to the host included); of the host's call, the time spent
loading the static inputs and launching the graph (the rest is the timing's own events).

A replay of the captured step on its own, after `generate_greedy`, would not time a step: the run has freed
its request rows and slots by then, so the replayed attention reads one padding slot from L2 (H100, E4B,
batch 32: 5.44 ms against 5.96 in the run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--phase", choices=("prefill", "decode"), default="prefill", help="What to profile.")
    parser.add_argument("--batch-size", type=int, default=1, help="Prompts in the batch.")
    parser.add_argument("--input-len", type=int, default=7000, help="Tokens per prompt.")
    parser.add_argument("--decode-steps", type=int, default=4, help="Decode steps profiled with --phase decode.")
    parser.add_argument("--rows", type=int, default=25, help="Operators to print per table.")
    parser.add_argument("--trace", help="Also write the profile as a Chrome trace here (bench/kernel_timeline.py).")
    args = parser.parse_args()
    runner = ModelRunner(ServerArgs.from_cli(args))
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=generator).tolist() for _ in range(args.batch_size)]
    decode_steps = args.decode_steps if args.phase == "decode" else 0
    for _ in range(2):
        generate_greedy(runner, prompts, 1 + decode_steps, keep_logits=False)  # compile kernels, warm up
    graphs = runner.decode_graphs.steps if runner.decode_graphs is not None else None
    if decode_steps and graphs is not None and graphs.use_graphs:  # before the profiler: it slows the host
        print_step_timeline(runner, prompts, decode_steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    # decode: the profiler skips the prefill (step 0) and records the decode steps; prefill: the one step, no
    # schedule (a schedule's cycle would end, and be cleared, at the step marker after it)
    steps = schedule(wait=1, warmup=0, active=decode_steps) if decode_steps else None
    with profile(activities=activities, schedule=steps) as prof:
        seconds = generate_greedy(
            runner, prompts, 1 + decode_steps, keep_logits=False, before_step=lambda step: step and prof.step()
        ).step_seconds
        if decode_steps:
            prof.step()
    timed = seconds[1:] if decode_steps else seconds
    print(f"{args.phase}: {sum(timed) / len(timed) * 1e3:.2f} ms per forward")
    sort = "cuda_time_total" if runner.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)


def print_step_timeline(runner: ModelRunner, prompts: list[list[int]], decode_steps: int) -> None:
    """Where a timed decode step's wall time goes: the host's `forward` call (input copies, graph launch),
    the device from the start of that call to the end of the forward's work, and of that the graph replay
    itself (the whole step also holds the argmax and the copy of the ids to the host)."""
    marks: list[tuple[float, float, torch.cuda.Event, torch.cuda.Event]] = []
    replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    host_replay: list[float] = []
    host_load: list[float] = []
    forward = runner.forward
    steps = runner.decode_graphs.steps
    graph = steps.graphs[steps.padded_size(len(prompts))]
    replay = graph.replay
    inputs = runner.decode_graphs.inputs
    load = inputs.load

    def timed_load(*args, **kwargs) -> None:
        start = time.perf_counter()
        load(*args, **kwargs)
        host_load.append(time.perf_counter() - start)

    def marked_forward(batch):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        begin.record()
        out = forward(batch)
        end.record()
        marks.append((host_start, time.perf_counter(), begin, end))
        return out

    def marked_replay() -> None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        replay()
        host_replay.append(time.perf_counter() - start)
        end.record()
        replays.append((begin, end))

    runner.forward, graph.replay, inputs.load = marked_forward, marked_replay, timed_load
    try:
        step_seconds = generate_greedy(runner, prompts, 1 + decode_steps, keep_logits=False).step_seconds[1:]
    finally:
        runner.forward, graph.replay, inputs.load = forward, replay, load
    torch.cuda.synchronize()
    host = statistics.mean(end - start for start, end, _, _ in marks[1:]) * 1e3
    device = statistics.mean(begin.elapsed_time(end) for _, _, begin, end in marks[1:])
    graph_ms = statistics.mean(begin.elapsed_time(end) for begin, end in replays)
    print(
        f"decode step timeline: step {statistics.mean(step_seconds) * 1e3:.3f} ms, of which the host's forward "
        f"call {host:.3f} ms (loading the inputs {statistics.mean(host_load) * 1e3:.3f}, launching the graph "
        f"{statistics.mean(host_replay) * 1e3:.3f}), the device's forward {device:.3f} ms, its graph replay "
        f"{graph_ms:.3f} ms"
    )


if __name__ == "__main__":
    main()
