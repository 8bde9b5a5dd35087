"""Run one static batch through the model in-process: a correctness check or a latency measurement.

Correctness (greedy tokens of given prompts, run together as one batch):
    python bench/bench_one_batch.py --model-path DIR --device cpu --dtype float32 --correctness-test \
        --prompt-ids-file prompts.json --max-new-tokens 16 --json out.json
Latency (random prompts at the real shapes):
    python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 1 8 \
        --input-len 2048 --output-len 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--correctness-test", action="store_true", help="Greedy outputs of --prompt-ids-file.")
    parser.add_argument("--prompt-ids-file", type=Path, help="JSON list of token-id lists (one per prompt).")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="Greedy tokens per prompt.")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1], help="Batch sizes to time.")
    parser.add_argument("--input-len", type=int, default=1024, help="Prompt tokens per request when timing.")
    parser.add_argument("--output-len", type=int, default=8, help="Decode steps when timing.")
    parser.add_argument("--json", type=Path, help="Write results here as JSON.")
    return parser.parse_args()


def run_correctness(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> dict:
    result = generate_greedy(runner, prompts, max_new_tokens)
    return {"output_ids": result.output_ids}


def run_latency(runner: ModelRunner, batch_sizes: list[int], input_len: int, output_len: int) -> dict:
    """Prefill and per-step decode time per batch size (the first batch size is also run once to warm up)."""
    vocab = runner.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    results = []
    for batch_size in tqdm([batch_sizes[0], *batch_sizes], desc="Batches", disable=None):
        prompts = [torch.randint(3, vocab, (input_len,), generator=generator).tolist() for _ in range(batch_size)]
        seconds = generate_greedy(runner, prompts, output_len + 1).step_seconds
        prefill, decode_step = seconds[0], sum(seconds[1:]) / output_len
        results.append(
            {
                "batch_size": batch_size,
                "input_len": input_len,
                "prefill_s": prefill,
                "prefill_tok_per_s": batch_size * input_len / prefill,
                "decode_step_s": decode_step,
                "decode_tok_per_s": batch_size / decode_step,
            }
        )
    return {"device": str(runner.device), "dtype": str(runner.dtype), "results": results[1:]}


def main() -> None:
    args = parse_args()
    runner = ModelRunner(ServerArgs.from_cli(args))
    if args.correctness_test:
        if args.prompt_ids_file is None:
            raise SystemExit("--correctness-test needs --prompt-ids-file")
        output = run_correctness(runner, json.loads(args.prompt_ids_file.read_text()), args.max_new_tokens)
    else:
        output = run_latency(runner, args.batch_size, args.input_len, args.output_len)
        for row in output["results"]:
            print(
                f"batch {row['batch_size']:4d} x {row['input_len']} tokens: prefill {row['prefill_s'] * 1e3:9.1f} ms"
                f" ({row['prefill_tok_per_s']:10.0f} tok/s), decode {row['decode_step_s'] * 1e3:8.2f} ms/step"
                f" ({row['decode_tok_per_s']:8.0f} tok/s)"
            )
    text = json.dumps(output)
    if args.json:
        args.json.write_text(text)
    if args.correctness_test:
        print(text)


if __name__ == "__main__":
    main()
