"""Profile one prefill with torch.profiler and print the top operators by GPU and by CPU time.

    python bench/profile_prefill.py --model-path gemma-4-E2B-it --load-format dummy --dtype bfloat16 \
        --max-total-tokens 24576 --batch-size 1 --input-len 7000
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="Prompts in the batch.")
    parser.add_argument("--input-len", type=int, default=7000, help="Tokens per prompt.")
    parser.add_argument("--rows", type=int, default=25, help="Operators to print per table.")
    args = parser.parse_args()
    runner = ModelRunner(ServerArgs.from_cli(args))
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=generator).tolist() for _ in range(args.batch_size)]
    for _ in range(2):
        generate_greedy(runner, prompts, 1)  # compile kernels, warm the allocator
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = generate_greedy(runner, prompts, 1).step_seconds[0]
    print(f"prefill {seconds * 1e3:.1f} ms")
    sort = "cuda_time_total" if runner.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
