"""Run one static batch through the model in-process: a correctness check or a latency measurement.

Correctness (greedy tokens of given prompts, run together as one batch):
    python bench/bench_one_batch.py --model-path DIR --device cpu --dtype float32 --correctness-test \
        --prompt-ids-file prompts.json --max-new-tokens 16 --json out.json
Latency (random prompts at the real shapes), each time beside its roofline floor and srt / floor:
    python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 1 8 \
        --input-len 2048 --output-len 8
Latency against transformers on the same device, dtype and prompts (srt is timed first and its runner
released, then transformers' Gemma4ForCausalLM with SDPA attention is built and timed the same way;
speedup = transformers time / srt time):
    python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 1 32 \
        --input-len 512 --output-len 16 --baseline transformers
Floors (bench/floors.py): max(FLOPs / matmul rate, bytes read and written / copy bandwidth), from the config
and rates measured on the device before the model is built (a device-to-device copy, an n^3 matmul in the
model's dtype); the JSON holds the rates, each floor's FLOPs and bytes, and the ratios.
MTP speculative decoding (bench/mtp_timing.py: plain decode step, draft round and verify step times, ms per
output token with and without the assistant; random weights accept nothing, so simulate an accept length):
    SRT_SIMULATE_ACCEPT_LEN=2.5 python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy \
        --speculative-draft-model-path gemma-4-E4B-it-assistant --batch-size 1 32 --input-len 512 --output-len 64
Tensor parallelism (bench/tp_timing.py: one process per rank, rank 0 reports times, KV pool per rank and the
all-reduce time of a decode step's message; no floors):
    python bench/bench_one_batch.py --model-path gemma-4-31B-it --load-format dummy --tp-size 2 --batch-size 1 32 \
        --input-len 512 --output-len 32
YOCO fast prefill A/B (prefill of the same prompts with the KV-shared layers on logits rows only, and on every
row; same weights, the model's YOCO flag flipped between runs; prints both times, their ratio and the ideal
ratio from layer FLOPs):
    python bench/bench_one_batch.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 1 \
        --input-len 7000 --yoco-ab
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path
from typing import NamedTuple

import torch
from batch_fit import BatchNeed, built_runner, kv_pools, prompt_batch, refuse_unfit, uniform_batch
from floors import DeviceRates, decode_floor, layer_flops, measure_device_rates, prefill_floor, weight_counts
from mtp_timing import print_mtp, run_mtp_latency
from tp_timing import run_tp_latency
from tqdm import tqdm
from transformers_baseline import GreedyRun, build_transformers_model, time_transformers

from srt.configs.model_config import ModelConfig, resolve_dtype
from srt.model_executor.model_runner import ModelRunner, resolve_device, resolve_load_format
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs

BASELINE_HELP = (
    "Also time transformers' Gemma4ForCausalLM (SDPA attention) on the same device, dtype and prompts, and print"
    " speedup = transformers time / srt time. srt runs first; its runner (weights and KV pools) is released"
    " before the transformers model is built, so the two never hold the GPU together (26B-A4B and 31B are 50-60"
    " GB each in bf16). Should srt memory outlive the release (a warning says how much), lower"
    " --mem-fraction-static so the KV pools leave room for transformers' weights and its KV cache, which grows"
    " with batch x (input + output) tokens. Random weights, unless srt loaded a checkpoint directory: then"
    " transformers loads it too and the greedy tokens of both are compared."
)


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
    parser.add_argument("--baseline", choices=["transformers"], help=BASELINE_HELP)
    parser.add_argument(
        "--trace",
        type=Path,
        help="With --speculative-draft-model-path: after the timed runs, profile a short decode of the first batch "
        "size, plain and with MTP, into TRACE-plain.json and TRACE-mtp.json (bench/kernel_timeline.py reads them).",
    )
    return parser.parse_args()


def run_correctness(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> dict:
    result = generate_greedy(runner, prompts, max_new_tokens)
    return {"output_ids": result.output_ids}


def make_prompts(vocab_size: int, batch_sizes: list[int], input_len: int) -> list[list[list[int]]]:
    """Random prompts per batch size, seeded: srt and the baseline run the same ones."""
    generator = torch.Generator().manual_seed(0)
    return [
        [torch.randint(3, vocab_size, (input_len,), generator=generator).tolist() for _ in range(batch_size)]
        for batch_size in batch_sizes
    ]


class LatencyRun(NamedTuple):
    output: dict  # what the JSON holds
    output_ids: list[list[list[int]]]  # srt's greedy tokens per batch, for the comparison with the baseline


def run_latency(runner: ModelRunner, batches: list[list[list[int]]], output_len: int) -> LatencyRun:
    """Prefill and per-step decode time per batch.

    Each batch runs twice and the second run is timed: the first compiles the Triton kernels for its
    shapes (seconds of JIT work that would otherwise pollute the figures).
    """
    results, output_ids = [], []
    for prompts in tqdm(batches, desc="Batches", disable=None):
        batch_size, input_len = len(prompts), len(prompts[0])
        generate_greedy(runner, prompts, output_len + 1, keep_logits=False)  # warm-up: kernel compilation
        result = generate_greedy(runner, prompts, output_len + 1, keep_logits=False)
        seconds = result.step_seconds
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
        output_ids.append(result.output_ids)
    return LatencyRun({"device": str(runner.device), "dtype": str(runner.dtype), "results": results}, output_ids)


def add_floors(
    results: list[dict],
    config: ModelConfig,
    dtype: torch.dtype,
    rates: DeviceRates,
    output_len: int,
    fp8_projections: bool = False,
) -> None:
    """Each row's prefill and decode floors, and srt / floor (how many times slower than the floor srt is);
    `fp8_projections` (--quantization fp8): the dense projections' weights count one byte each."""
    for row in results:
        prefill = prefill_floor(config, dtype, rates, row["batch_size"], row["input_len"], fp8_projections)
        decode = decode_floor(config, dtype, rates, row["batch_size"], row["input_len"], output_len, fp8_projections)
        row["output_len"] = output_len
        row["prefill_floor"], row["decode_floor"] = prefill.as_json(), decode.as_json()
        row["prefill_over_floor"] = row["prefill_s"] / prefill.seconds
        row["decode_over_floor"] = row["decode_step_s"] / decode.seconds


def add_baseline(results: list[dict], runs: list[GreedyRun], srt_output_ids: list[list[list[int]]] | None) -> None:
    """transformers' times per row, its ratios to the floors, and speedup = transformers time / srt time.

    With `srt_output_ids` (both loaded the same checkpoint), whether the greedy tokens are the same.
    """
    for index, (row, run) in enumerate(zip(results, runs)):
        prefill, decode_step = run.step_seconds[0], statistics.mean(run.step_seconds[1:])
        theirs = {
            "prefill_s": prefill,
            "prefill_tok_per_s": row["batch_size"] * row["input_len"] / prefill,
            "decode_step_s": decode_step,
            "decode_tok_per_s": row["batch_size"] / decode_step,
            "prefill_over_floor": prefill / row["prefill_floor"]["seconds"],
            "decode_over_floor": decode_step / row["decode_floor"]["seconds"],
        }
        if srt_output_ids is not None:
            theirs["same_greedy_tokens"] = run.output_ids == srt_output_ids[index]
        row["transformers"] = theirs
        row["prefill_speedup"] = prefill / row["prefill_s"]
        row["decode_speedup"] = decode_step / row["decode_step_s"]


def release_device_memory(device: torch.device, released: str) -> None:
    """Drop what nothing references any more and hand the cached blocks back; warn if much stays allocated."""
    gc.collect()  # a model's modules may sit in reference cycles
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(device)
    if held > 1024**3:
        print(
            f"warning: {held / 1024**3:.1f} GiB of device memory still allocated after {released} was released"
            " (a reference outlives it); if the transformers baseline runs out of memory, lower"
            " --mem-fraction-static"
        )


def run_latency_mode(server_args: ServerArgs, args: argparse.Namespace) -> dict:
    """srt's times and floors per batch size; then, with --baseline, transformers' times on the same prompts."""
    device = resolve_device(server_args.device)
    dtype = resolve_dtype(server_args.dtype, device)
    # measured before the runner exists: its KV pools may take the memory the copy buffers need
    rates = measure_device_rates(device, dtype)
    runner = built_runner(server_args, batch_needs(args))
    config = runner.model_config
    batches = make_prompts(config.vocab_size, args.batch_size, args.input_len)
    latency = run_latency(runner, batches, args.output_len)
    output = latency.output
    fp8 = server_args.quantization == "fp8"
    add_floors(output["results"], config, dtype, rates, args.output_len, fp8)
    output["quantization"] = server_args.quantization
    output["device_rates"] = rates.as_json()
    output["kv_pools"] = kv_pools(runner)
    counts = weight_counts(config)
    output["weights"] = {
        # what the floors are counted from (FP8 projections: one byte each)
        "counted_bytes": counts.total * dtype.itemsize - (counts.projections * (dtype.itemsize - 1) if fp8 else 0),
        "model_parameter_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
    }
    if args.baseline == "transformers":
        checkpoint = Path(server_args.model_path) if resolve_load_format(server_args) != "dummy" else None
        del runner  # srt is timed: its weights and KV pools make way for transformers'
        release_device_memory(device, "srt's runner")
        model = build_transformers_model(config, device, dtype, checkpoint)
        runs = time_transformers(model, batches, args.output_len)
        del model
        release_device_memory(device, "the transformers model")
        add_baseline(output["results"], runs, latency.output_ids if checkpoint is not None else None)
        output["baseline"] = "transformers"
    return output


def print_latency(output: dict) -> None:
    rates = output["device_rates"]
    print(
        f"device rates: copy {rates['copy_GBps']:.1f} GB/s ({rates['copy_bytes'] / 1024**2:.0f} MiB),"
        f" matmul {rates['matmul_TFLOPs']:.2f} TFLOP/s ({rates['matmul_size']}^3, {output['dtype']})"
    )
    for row in output["results"]:
        print(
            f"batch {row['batch_size']:4d} x {row['input_len']} tokens: prefill {row['prefill_s'] * 1e3:9.1f} ms"
            f" ({row['prefill_tok_per_s']:10.0f} tok/s), decode {row['decode_step_s'] * 1e3:8.2f} ms/step"
            f" ({row['decode_tok_per_s']:8.0f} tok/s)"
        )
        print(
            f"    floor: prefill {row['prefill_floor']['seconds'] * 1e3:9.3f} ms ({row['prefill_floor']['bound']}),"
            f" decode {row['decode_floor']['seconds'] * 1e3:8.3f} ms/step ({row['decode_floor']['bound']});"
            f" srt / floor: prefill {row['prefill_over_floor']:6.1f}x, decode {row['decode_over_floor']:6.1f}x"
        )
        theirs = row.get("transformers")
        if theirs is not None:
            same = f", same greedy tokens: {theirs['same_greedy_tokens']}" if "same_greedy_tokens" in theirs else ""
            print(
                f"    transformers: prefill {theirs['prefill_s'] * 1e3:9.1f} ms, decode"
                f" {theirs['decode_step_s'] * 1e3:8.2f} ms/step; speedup (transformers / srt): prefill"
                f" {row['prefill_speedup']:5.2f}x, decode {row['decode_speedup']:5.2f}x{same}"
            )


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


def batch_needs(args: argparse.Namespace, prompts: list[list[int]] | None = None) -> list[BatchNeed]:
    """The KV each mode's batches hold at their end (see batch_fit)."""
    if args.correctness_test:
        return [prompt_batch(prompts, args.max_new_tokens)]
    steps = 1 if args.yoco_ab else args.output_len + 1  # the prefill, then output_len decode steps
    return [uniform_batch(batch_size, args.input_len, steps) for batch_size in args.batch_size]


def main() -> None:
    args = parse_args()
    server_args = ServerArgs.from_cli(args)
    if args.baseline and (args.correctness_test or args.yoco_ab):
        raise SystemExit("--baseline applies to latency mode only (not to --correctness-test or --yoco-ab)")
    prompts = None
    if args.correctness_test:
        if args.prompt_ids_file is None:
            raise SystemExit("--correctness-test needs --prompt-ids-file")
        prompts = json.loads(args.prompt_ids_file.read_text())
    needs = batch_needs(args, prompts)
    if server_args.tp_size > 1:
        if args.correctness_test or args.yoco_ab or args.baseline or server_args.speculative_algorithm:
            raise SystemExit("--tp-size > 1 times plain latency only")
        vocab = ModelConfig.from_name_or_path(server_args.model_path).vocab_size
        batches = make_prompts(vocab, args.batch_size, args.input_len)
        run_tp_latency(server_args, batches, args.output_len, needs, args.json)
        return
    refuse_unfit(server_args, needs)  # before any weight, pool or device-rate buffer is allocated
    if args.correctness_test:
        output = run_correctness(built_runner(server_args, needs), prompts, args.max_new_tokens)
    elif args.yoco_ab:
        output = run_yoco_ab(built_runner(server_args, needs), args.batch_size, args.input_len, args.repeats)
        for row in output["yoco_ab"]:
            print(
                f"batch {row['batch_size']:4d} x {row['input_len']} tokens: prefill YOCO on"
                f" {row['prefill_on_s'] * 1e3:9.1f} ms, off {row['prefill_off_s'] * 1e3:9.1f} ms,"
                f" speedup {row['speedup']:5.2f}x (ideal by layer FLOPs {row['ideal_speedup']:5.2f}x),"
                f" max |logit diff| {row['max_logit_diff']:.2e}, same greedy token: {row['same_greedy_token']}"
            )
    elif server_args.speculative_algorithm:
        output = run_mtp_latency(server_args, args.batch_size, args.input_len, args.output_len, args.trace)
        print_mtp(output)
    else:
        output = run_latency_mode(server_args, args)
        print_latency(output)
    text = json.dumps(output)
    if args.json:
        args.json.write_text(text)
    if args.correctness_test:
        print(text)


if __name__ == "__main__":
    main()
