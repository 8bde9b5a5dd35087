"""Steps of a few hundred to a few thousand tokens with CUDA graphs per token count and eagerly, side by side.

One runner; each step is run both ways (the runner's token-count graphs used, then set aside), alternating
for --rounds rounds, and timed as the wall time of --calls identical steps back to back (what a serving step
pays: an eager step of a few hundred tokens is bound by the host's kernel launches, not by the GPU). A step
is one prompt of L tokens (--prefill-lens), beside B decoding requests of --decode-context tokens each
(--decode-rows; B > 0 is a mixed step). Repeating a step rewrites the same KV slots with the same values, so
every call does the same work. Prefill floors as in bench_one_batch (`bench/floors.py`).

    python bench/bench_graph_steps.py --model-path gemma-4-E4B-it --load-format dummy --dtype bfloat16 \
        --prefill-lens 128 512 1000 2000 --decode-rows 0 31 --json graph-steps-E4B.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from batch_fit import built_runner, uniform_batch
from floors import measure_device_rates, prefill_floor
from timing import synchronize, write_json
from tqdm import tqdm

from srt.configs.model_config import resolve_dtype
from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner, resolve_device
from srt.server_args import ServerArgs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512, 1000, 2000], help="Prompt tokens.")
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[0, 31], help="Decoding requests beside it.")
    parser.add_argument("--decode-context", type=int, default=1000, help="Tokens of each decoding request.")
    parser.add_argument("--calls", type=int, default=20, help="Steps back to back per timing.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternations of graphs and eager (median kept).")
    parser.add_argument("--json", type=Path, help="Write results here as JSON.")
    return parser.parse_args()


class Step:
    """One forward's batch, its KV slots held until `release`."""

    def __init__(self, runner: ModelRunner, prompt_len: int, decode_rows: int, context: int) -> None:
        self.runner = runner
        vocab = runner.model_config.vocab_size
        generator = torch.Generator().manual_seed(prompt_len * 1000 + decode_rows)
        self.rows = [runner.req_to_token_pool.alloc() for _ in range(decode_rows + 1)]
        lens = [context + 1] * decode_rows + [prompt_len]  # tokens with KV once the step has run
        self.slots = [runner.token_allocator.alloc(n) for n in lens]
        for row, slots in zip(self.rows, self.slots, strict=True):
            runner.req_to_token_pool.write(row, 0, slots)
        new_tokens = [torch.randint(3, vocab, (1,), generator=generator).tolist() for _ in range(decode_rows)]
        new_tokens.append(torch.randint(3, vocab, (prompt_len,), generator=generator).tolist())
        prefix_lens = [context] * decode_rows + [0]
        # decoding requests' earlier KV is whatever the slots hold: attention reads it all the same
        self.batch = ForwardBatch.build(
            mode=ForwardMode.EXTEND,
            new_token_ids=new_tokens,
            prefix_lens=prefix_lens,
            req_pool_indices=self.rows,
            out_cache_loc=torch.cat([s[p:] for s, p in zip(self.slots, prefix_lens, strict=True)]),
            logits_rows=[*range(decode_rows), decode_rows + prompt_len - 1],
            req_to_token_pool=runner.req_to_token_pool,
            kv_pool=runner.kv_pool,
        )

    def seconds(self, calls: int, use_graphs: bool) -> float:
        runner, graphs = self.runner, self.runner.extend_graphs
        if use_graphs and (graphs is None or not graphs.can_run(self.batch)):
            tokens = self.batch.num_tokens
            raise SystemExit(f"no token-count graph takes {tokens} tokens: raise --cuda-graph-max-tokens")
        runner.extend_graphs = graphs if use_graphs else None
        try:
            runner.forward(self.batch)  # the first call of a shape compiles
            synchronize(runner.device)
            start = time.perf_counter()
            for _ in range(calls):
                runner.forward(self.batch)
            synchronize(runner.device)
            return (time.perf_counter() - start) / calls
        finally:
            runner.extend_graphs = graphs

    def release(self) -> None:
        for slots in self.slots:
            self.runner.token_allocator.free(slots)
        for row in self.rows:
            self.runner.req_to_token_pool.free(row)


def main() -> None:
    args = parse_args()
    server_args = ServerArgs.from_cli(args)
    device = resolve_device(server_args.device)
    dtype = resolve_dtype(server_args.dtype, device)
    rates = measure_device_rates(device, dtype)
    longest = max(args.prefill_lens) + max(args.decode_rows) * (args.decode_context + 1)
    runner = built_runner(server_args, [uniform_batch(1, longest, 1)])
    if device.type == "cpu":  # no graphs: the padded steps run eagerly (a check of this script, not a figure)
        runner.capture_cuda_graphs(use_graphs=False)
    results = []
    settings = [(n, b) for b in args.decode_rows for n in args.prefill_lens]
    for prompt_len, decode_rows in tqdm(settings, desc="steps"):
        step = Step(runner, prompt_len, decode_rows, args.decode_context)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for use_graphs in (True, False):
                times[use_graphs].append(step.seconds(args.calls, use_graphs))
        step.release()
        graphed, eager = statistics.median(times[True]), statistics.median(times[False])
        floor = prefill_floor(runner.model_config, dtype, rates, 1, prompt_len)
        results.append(
            {
                "prompt_len": prompt_len,
                "decode_rows": decode_rows,
                "decode_context": args.decode_context,
                "tokens": step.batch.num_tokens,
                "graphs_s": graphed,
                "eager_s": eager,
                "speedup": eager / graphed,
                "prefill_floor_s": floor.seconds,
                "graphs_over_prefill_floor": graphed / floor.seconds,
            }
        )
        print(
            f"prompt {prompt_len:5d} + {decode_rows:3d} decode rows ({step.batch.num_tokens:5d} tokens):"
            f" graphs {graphed * 1e3:7.2f} ms, eager {eager * 1e3:7.2f} ms ({eager / graphed:4.1f}x);"
            f" prefill floor {floor.seconds * 1e3:6.2f} ms"
        )
    payload = {"device": str(device), "dtype": str(dtype), "device_rates": rates.as_json(), "results": results}
    write_json(args.json, "graph-steps.json", payload)


if __name__ == "__main__":
    main()
