"""Structured outputs' cost per decode step: a batch of json_schema requests beside the same batch unconstrained.

    python bench/bench_grammar.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 32 --output-len 64

In-process (one Scheduler, the server's defaults: CUDA graphs, the overlap schedule), the same random prompts
twice: every request free (`ignore_eos`), then every request constrained by a JSON schema whose one string field
a random model seldom closes, so both batches run close to --output-len steps. Per batch: wall time, decode
steps (the longest output), seconds per step, output tokens per second and the mean output length; then the
step overhead of the constrained batch (its seconds per step over the free batch's, minus 1). Each batch runs
once untimed first (kernel compilation, the grammar's compilation and the matchers' warm-up).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.managers.tokenizer_loader import load_grammar_vocab
from srt.sampling.grammar import GrammarCompiler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})


def requests(prompts: list[list[int]], output_len: int, grammar: str | None, tag: str) -> list[TokenizedGenerateReq]:
    out = []
    for i, ids in enumerate(prompts):
        extra = {"json_schema": SCHEMA} if grammar is not None else {"ignore_eos": True}
        params = SamplingParams(temperature=0.0, max_new_tokens=output_len, **extra)
        req = TokenizedGenerateReq(f"{tag}-{i}", ids, params)
        req.grammar = grammar
        out.append(req)
    return out


def timed(scheduler: Scheduler, make: Callable[[str], list[TokenizedGenerateReq]]) -> dict:
    run_to_completion(scheduler, make("warm"))
    start = time.perf_counter()
    results = run_to_completion(scheduler, make("timed"))
    seconds = time.perf_counter() - start
    lengths = [len(result.output_ids) for result in results.values()]
    steps = max(lengths)
    return {
        "seconds": seconds,
        "steps": steps,
        "step_s": seconds / steps,
        "tok_per_s": sum(lengths) / seconds,
        "mean_output_len": sum(lengths) / len(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="Requests per batch.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=64, help="Most output tokens per request.")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args()
    server_args = ServerArgs.from_cli(args)
    scheduler = Scheduler(server_args)
    runner = scheduler.runner
    vocab = runner.model_config.vocab_size
    compiler = GrammarCompiler(load_grammar_vocab(server_args, vocab, sorted(runner.eos_token_ids)))
    grammar = compiler.compile("json_schema", SCHEMA)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    free = timed(scheduler, lambda tag: requests(prompts, args.output_len, None, f"free-{tag}"))
    constrained = timed(scheduler, lambda tag: requests(prompts, args.output_len, grammar, f"schema-{tag}"))
    overhead = constrained["step_s"] / free["step_s"] - 1
    for name, row in (("free", free), ("json_schema", constrained)):
        print(
            f"{name:12s} batch {args.batch_size}: {row['steps']} steps, {row['step_s'] * 1e3:7.2f} ms/step,"
            f" {row['tok_per_s']:8.0f} tok/s, mean output {row['mean_output_len']:.1f} tokens"
        )
    print(f"json_schema decode step overhead: {overhead * 100:+.1f}%")
    if args.json:
        output = {"batch_size": args.batch_size, "free": free, "json_schema": constrained, "step_overhead": overhead}
        args.json.write_text(json.dumps(output))


if __name__ == "__main__":
    main()
