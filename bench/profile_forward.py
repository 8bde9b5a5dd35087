"""Profile one prefill, or the decode steps after it, with torch.profiler; print the top operators.

    python bench/profile_forward.py --model-path gemma-4-E2B-it --load-format dummy --dtype bfloat16 \
        --max-total-tokens 24576 --batch-size 1 --input-len 7000
    python bench/profile_forward.py --model-path gemma-4-E4B-it --load-format dummy --phase decode \
        --batch-size 1 --input-len 512 --disable-cuda-graph

Kernels of a replayed CUDA graph are not listed one by one: profile decode with --disable-cuda-graph to see
them (their GPU times are the same; the host launch times are what the graph removes). With graphs, decode
also prints the device time of the captured step replayed back to back: what a step costs without the host's
input copies, sampling and synchronisation around it.
"""

from __future__ import annotations

import argparse

import torch
from timing import time_cuda
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
    args = parser.parse_args()
    runner = ModelRunner(ServerArgs.from_cli(args))
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=generator).tolist() for _ in range(args.batch_size)]
    decode_steps = args.decode_steps if args.phase == "decode" else 0
    for _ in range(2):
        generate_greedy(runner, prompts, 1 + decode_steps, keep_logits=False)  # compile kernels, warm up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    # the profiler records only the steps of the chosen phase: prefill is step 0
    skip = 1 if decode_steps else 0
    with profile(activities=activities, schedule=schedule(wait=skip, warmup=0, active=max(decode_steps, 1))) as prof:
        seconds = generate_greedy(
            runner, prompts, 1 + decode_steps, keep_logits=False, before_step=lambda step: step and prof.step()
        ).step_seconds
        prof.step()
    timed = seconds[1:] if decode_steps else seconds
    print(f"{args.phase}: {sum(timed) / len(timed) * 1e3:.2f} ms per forward")
    sort = "cuda_time_total" if runner.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    graphs = runner.decode_graphs.steps if runner.decode_graphs is not None else None
    if decode_steps and graphs is not None and graphs.use_graphs:
        replay = graphs.graphs[graphs.padded_size(args.batch_size)].replay
        print(f"decode graph replay alone: {time_cuda(replay, warmup=5, repeats=50) * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
