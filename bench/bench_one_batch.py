"""Run one static batch through the model in-process: a correctness check or a latency measurement.

Correctness (greedy tokens of given prompts, run together as one batch):
    python bench/bench_one_batch.py --model-path DIR --device cpu --dtype float32 --correctness-test \
        --prompt-ids-file prompts.json --max-new-tokens 16 --json out.json
Latency (random prompts at the real shapes):
    python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 1 8 \
        --input-len 2048 --output-len 8
YOCO fast prefill A/B (prefill of the same prompts with the KV-shared layers on logits rows only, and on every
row; same weights, the model's YOCO flag flipped between runs; prints both times, their ratio and the ideal
ratio from layer FLOPs):
    python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 1 \
        --input-len 7000 --yoco-ab
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from srt.configs.model_config import ModelConfig
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
    parser.add_argument(
        "--yoco-ab",
        action="store_true",
        help="Time prefill with YOCO on and off, side by side, for each --batch-size x --input-len.",
    )
    parser.add_argument("--repeats", type=int, default=3, help="Prefills per setting in --yoco-ab (median kept).")
    return parser.parse_args()


def run_correctness(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> dict:
    result = generate_greedy(runner, prompts, max_new_tokens)
    return {"output_ids": result.output_ids}


def run_latency(runner: ModelRunner, batch_sizes: list[int], input_len: int, output_len: int) -> dict:
    """Prefill and per-step decode time per batch size.

    Each batch size runs twice and the second run is timed: the first compiles the Triton kernels for its
    shapes (seconds of JIT work that would otherwise pollute the figures).
    """
    vocab = runner.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    results = []
    for batch_size in tqdm(batch_sizes, desc="Batches", disable=None):
        prompts = [torch.randint(3, vocab, (input_len,), generator=generator).tolist() for _ in range(batch_size)]
        generate_greedy(runner, prompts, output_len + 1)  # warm-up: kernel compilation
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
    return {"device": str(runner.device), "dtype": str(runner.dtype), "results": results}


def layer_flops(config: ModelConfig, positions: list[int], yoco_rows: list[int] | None) -> float:
    """Matmul FLOPs of the decoder layers for query rows at `positions` (one prompt).

    Projections, MLP and per-layer-input gates cost 2 * in * out per row; attention costs 4 * heads * head_dim
    per (query, visible key) pair, counting only pairs the causal / sliding mask keeps. With `yoco_rows`
    (indices into `positions`), KV-shared layers run on those rows only.
    """
    hf = config.hf_text_config
    hidden, ple = hf.hidden_size, hf.hidden_size_per_layer_input or 0
    total = 0.0
    for spec in config.layers:
        rows = positions if spec.owns_kv or yoco_rows is None else [positions[i] for i in yoco_rows]
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv_projections = 0 if not spec.owns_kv else (1 if spec.k_eq_v else 2)
        mlp_width = hf.intermediate_size * (2 if hf.use_double_wide_mlp and not spec.owns_kv else 1)
        per_row = 2 * hidden * (2 * q_width + kv_projections * kv_width + 3 * mlp_width + 2 * ple)
        keys = sum(pos + 1 if spec.sliding_window is None else min(pos + 1, spec.sliding_window) for pos in rows)
        total += per_row * len(rows) + 4 * q_width * keys
    return total


def ideal_yoco_speedup(config: ModelConfig, input_len: int) -> float:
    """Layer FLOPs without YOCO over layer FLOPs with it, for fresh prompts that need only their last row.

    Every prompt of a batch of equal-length prompts costs the same, so the batch size drops out.
    """
    positions = list(range(input_len))
    return layer_flops(config, positions, None) / layer_flops(config, positions, [input_len - 1])


def run_yoco_ab(runner: ModelRunner, batch_sizes: list[int], input_len: int, repeats: int) -> dict:
    """Prefill time per batch size with YOCO on and off: the same prompts, alternating, median of `repeats`."""
    config = runner.model_config
    if config.first_kv_shared_layer is None:
        raise SystemExit(f"{runner.server_args.model_path} has no KV-shared layers: YOCO changes nothing")
    text_model = runner.model.model
    was_on = text_model.yoco_layer is not None
    generator = torch.Generator().manual_seed(0)
    results = []
    try:
        for index, batch_size in enumerate(tqdm([batch_sizes[0], *batch_sizes], desc="Batches", disable=None)):
            prompts = [
                torch.randint(3, config.vocab_size, (input_len,), generator=generator).tolist()
                for _ in range(batch_size)
            ]
            seconds: dict[bool, list[float]] = {True: [], False: []}
            logits: dict[bool, torch.Tensor] = {}
            skipped: dict[bool, int] = {}
            for _ in range(1 if index == 0 else repeats):  # the first batch size is also run once to warm up
                for on in (True, False):
                    text_model.set_yoco(on)
                    skipped_before = runner.yoco_rows_skipped_total
                    result = generate_greedy(runner, prompts, 1)
                    seconds[on].append(result.step_seconds[0])
                    logits[on] = result.step_logits[0]
                    skipped[on] = runner.yoco_rows_skipped_total - skipped_before
            on_s, off_s = statistics.median(seconds[True]), statistics.median(seconds[False])
            results.append(
                {
                    "batch_size": batch_size,
                    "input_len": input_len,
                    "prefill_on_s": on_s,
                    "prefill_off_s": off_s,
                    "speedup": off_s / on_s,
                    "ideal_speedup": ideal_yoco_speedup(config, input_len),
                    "rows_skipped": skipped[True],
                    "max_logit_diff": float((logits[True] - logits[False]).abs().max()),
                    "same_greedy_token": bool(torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))),
                }
            )
    finally:
        text_model.set_yoco(was_on)
    return {"device": str(runner.device), "dtype": str(runner.dtype), "yoco_ab": results[1:]}


def main() -> None:
    args = parse_args()
    runner = ModelRunner(ServerArgs.from_cli(args))
    if args.correctness_test:
        if args.prompt_ids_file is None:
            raise SystemExit("--correctness-test needs --prompt-ids-file")
        output = run_correctness(runner, json.loads(args.prompt_ids_file.read_text()), args.max_new_tokens)
    elif args.yoco_ab:
        output = run_yoco_ab(runner, args.batch_size, args.input_len, args.repeats)
        for row in output["yoco_ab"]:
            print(
                f"batch {row['batch_size']:4d} x {row['input_len']} tokens: prefill YOCO on"
                f" {row['prefill_on_s'] * 1e3:9.1f} ms, off {row['prefill_off_s'] * 1e3:9.1f} ms,"
                f" speedup {row['speedup']:5.2f}x (ideal by layer FLOPs {row['ideal_speedup']:5.2f}x),"
                f" max |logit diff| {row['max_logit_diff']:.2e}, same greedy token: {row['same_greedy_token']}"
            )
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
