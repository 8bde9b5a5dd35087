"""Steps of a few hundred to a few thousand tokens with CUDA graphs per token count and eagerly, side by side.

One runner; each step is run both ways (the runner's token-count graphs used, then set aside), alternating
for --rounds rounds, and timed as the wall time of --calls identical steps back to back (what a serving step
pays: an eager step of a few hundred tokens is bound by the host's kernel launches, not by the GPU). A step
is one prompt of L new tokens (--prefill-lens) after P cached ones (--prompt-prefix: a later chunk of a
chunked prompt), beside B decoding requests of --decode-context tokens each (--decode-rows; B > 0 is a mixed
step). Steps longer than --cuda-graph-max-tokens are timed eagerly only. --profile prints each step's
heaviest kernels (one eager call under torch.profiler). Repeating a step rewrites the same KV slots with the
same values, so every call does the same work. Prefill floors as in bench_one_batch (`bench/floors.py`).

    python bench/bench_graph_steps.py --model-path gemma-4-E4B-it --load-format dummy --dtype bfloat16 \
        --prefill-lens 128 512 1000 2000 --decode-rows 0 31 --json graph-steps-E4B.json
    python bench/bench_graph_steps.py --model-path gemma-4-E4B-it --load-format dummy --dtype bfloat16 \
        --prefill-lens 2048 --prompt-prefix 0 6144 --decode-rows 31 --decode-context 8192 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from batch_fit import BatchNeed, built_runner
from floors import measure_device_rates, prefill_floor
from timing import synchronize, write_json
from torch.profiler import ProfilerActivity
from tqdm import tqdm

from srt.configs.model_config import resolve_dtype
from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner, resolve_device
from srt.server_args import ServerArgs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512, 1000, 2000], help="Prompt tokens.")
    parser.add_argument("--prompt-prefix", type=int, nargs="+", default=[0], help="Cached prompt tokens before them.")
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[0, 31], help="Decoding requests beside it.")
    parser.add_argument("--decode-context", type=int, default=1000, help="Tokens of each decoding request.")
    parser.add_argument("--calls", type=int, default=20, help="Steps back to back per timing.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternations of graphs and eager (median kept).")
    parser.add_argument("--profile", action="store_true", help="Print each step's heaviest kernels.")
    parser.add_argument("--json", type=Path, help="Write results here as JSON.")
    return parser.parse_args()


class Step:
    """One forward's batch, its KV slots held until `release`."""

    def __init__(self, runner: ModelRunner, prompt_len: int, decode_rows: int, context: int, prefix: int = 0) -> None:
        self.runner = runner
        vocab = runner.model_config.vocab_size
        generator = torch.Generator().manual_seed(prompt_len * 1000 + decode_rows)
        self.rows = [runner.req_to_token_pool.alloc() for _ in range(decode_rows + 1)]
        lens = [context + 1] * decode_rows + [prefix + prompt_len]  # tokens with KV once the step has run
        self.slots = [runner.token_allocator.alloc(n) for n in lens]
        for row, slots in zip(self.rows, self.slots, strict=True):
            runner.req_to_token_pool.write(row, 0, slots)
        new_tokens = [torch.randint(3, vocab, (1,), generator=generator).tolist() for _ in range(decode_rows)]
        new_tokens.append(torch.randint(3, vocab, (prompt_len,), generator=generator).tolist())
        prefix_lens = [context] * decode_rows + [prefix]
        # cached KV (decoding requests', the prompt's earlier chunks) is whatever the slots hold: attention reads
        # it all the same
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

    def graphed(self) -> bool:
        graphs = self.runner.extend_graphs
        return graphs is not None and graphs.can_run(self.batch)

    @contextlib.contextmanager
    def graphs_used(self, use_graphs: bool) -> Iterator[None]:
        """The runner's token-count graphs, or none (every step eager), while inside."""
        runner, graphs = self.runner, self.runner.extend_graphs
        runner.extend_graphs = graphs if use_graphs else None
        try:
            yield
        finally:
            runner.extend_graphs = graphs

    def seconds(self, calls: int, use_graphs: bool) -> float:
        runner = self.runner
        with self.graphs_used(use_graphs):
            runner.forward(self.batch)  # the first call of a shape compiles
            synchronize(runner.device)
            start = time.perf_counter()
            for _ in range(calls):
                runner.forward(self.batch)
            synchronize(runner.device)
            return (time.perf_counter() - start) / calls

    def print_profile(self, kernels: int = 12) -> None:
        """The step's heaviest kernels in one eager call (compiled by the timed ones) under torch.profiler."""
        with self.graphs_used(False), torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.runner.forward(self.batch)
            synchronize(self.runner.device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=kernels, max_name_column_width=60))

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
    prompt = max(args.prompt_prefix) + max(args.prefill_lens)
    rows = max(args.decode_rows)
    need = BatchNeed(rows + 1, prompt + rows * (args.decode_context + 1), max(prompt, args.decode_context + 1), 0)
    runner = built_runner(server_args, [need])
    if device.type == "cpu":  # no graphs: the padded steps run eagerly (a check of this script, not a figure)
        runner.capture_cuda_graphs(use_graphs=False)
    results = []
    settings = [(p, n, b) for b in args.decode_rows for p in args.prompt_prefix for n in args.prefill_lens]
    for prefix, prompt_len, decode_rows in tqdm(settings, desc="steps"):
        step = Step(runner, prompt_len, decode_rows, args.decode_context, prefix)
        ways = (True, False) if step.graphed() else (False,)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for use_graphs in ways:
                times[use_graphs].append(step.seconds(args.calls, use_graphs))
        if args.profile and device.type == "cuda":
            step.print_profile()
        step.release()
        eager = statistics.median(times[False])
        graphed = statistics.median(times[True]) if times[True] else None
        floor = prefill_floor(runner.model_config, dtype, rates, 1, prompt_len)
        results.append(
            {
                "prompt_prefix": prefix,
                "prompt_len": prompt_len,
                "decode_rows": decode_rows,
                "decode_context": args.decode_context,
                "tokens": step.batch.num_tokens,
                "graphs_s": graphed,
                "eager_s": eager,
                "speedup": eager / graphed if graphed else None,
                "prefill_floor_s": floor.seconds,
                "graphs_over_prefill_floor": graphed / floor.seconds if graphed else None,
            }
        )
        shown = f"graphs {graphed * 1e3:7.2f} ms, " if graphed else ""
        print(
            f"prompt {prefix:5d} + {prompt_len:5d} + {decode_rows:3d} decode rows ({step.batch.num_tokens:5d} tokens):"
            f" {shown}eager {eager * 1e3:7.2f} ms; prefill floor {floor.seconds * 1e3:6.2f} ms"
        )
    payload = {"device": str(device), "dtype": str(dtype), "device_rates": rates.as_json(), "results": results}
    write_json(args.json, "graph-steps.json", payload)


if __name__ == "__main__":
    main()
