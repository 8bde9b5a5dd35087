"""How much of a decode step is the GPU's work and how much the host's, at the batch sizes of #7.

    python bench/decode_host_gap.py --model-path gemma-4-E4B-it --load-format dummy --dtype bfloat16 \
        --batch-size 1 32 --input-len 512

For each batch size, after a prefill of random prompts, decode is timed these ways (ms per step, median of
--repeats runs of --steps steps):
- `serial`, `overlap`: `generate_greedy`'s decode steps (what bench_one_batch reports) without and with the
  overlap schedule; `waiting`: the host's time per overlapped step spent waiting for the device's ids
  (near a whole step when the GPU is the bottleneck); `replay in overlap` and `between replays`: the GPU's
  time in each overlapped step's graph and between graphs (CUDA events);
and on one prebuilt decode batch:
- `forward+read`: the same prebuilt batch each step: `runner.forward` then the ids to the host;
- `replay+sync`: the captured graph's replay, then a device sync (no input loading, no copy out);
- `replays`: back-to-back replays between two CUDA events: the GPU's time alone;
- `overlapped`: replays fed by the previous step's ids on the device, each step's ids read on the host after
  the next step is launched (what an overlap scheduler does).
`serial - replays` is the host's share of a step, which the overlap schedule hides.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from srt.host_device import DeviceToHost
from srt.model_executor.captured_steps import CapturedSteps
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs


def decode_batch(runner: ModelRunner, rows: list[int], context: int, slots: torch.Tensor) -> ForwardBatch:
    return ForwardBatch.build(
        mode=ForwardMode.DECODE,
        new_token_ids=[[1] for _ in rows],
        prefix_lens=[context] * len(rows),
        req_pool_indices=rows,
        out_cache_loc=slots,
        logits_rows=list(range(len(rows))),
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
    )


@contextlib.contextmanager
def waiting_time() -> Iterator[list[float]]:
    """[total, first] seconds the host spends in `DeviceToHost.get` (waiting for the device) inside the block."""
    seconds = [0.0, 0.0]
    get = DeviceToHost.get

    def timed(self: DeviceToHost) -> list[torch.Tensor]:
        start = time.perf_counter()
        try:
            return get(self)
        finally:
            waited = time.perf_counter() - start
            seconds[0] += waited
            seconds[1] = seconds[1] or waited

    DeviceToHost.get = timed
    try:
        yield seconds
    finally:
        DeviceToHost.get = get


@contextlib.contextmanager
def replay_events(steps: CapturedSteps) -> Iterator[list[tuple[torch.cuda.Event, torch.cuda.Event]]]:
    """CUDA events recorded just before and after every graph replay inside the block."""
    events = []
    run = steps.run

    def timed(batch_size: int) -> object:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        output = run(batch_size)
        end.record()
        events.append((begin, end))
        return output

    steps.run = timed
    try:
        yield events
    finally:
        del steps.run


def wall_ms(step, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def replay_ms(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def measure(runner: ModelRunner, batch_size: int, input_len: int, steps: int, repeats: int) -> dict:
    vocab = runner.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(0, vocab, (batch_size, input_len), generator=generator).tolist()
    generate_greedy(runner, prompts, steps + 1, keep_logits=False)  # compiles this shape's kernels
    decode_ms = {"serial": [], "overlap": [], "replay in overlap": [], "between replays": []}
    waited = []
    for _ in range(repeats):
        for name in ("serial", "overlap"):
            with waiting_time() as seconds, replay_events(runner.decode_graphs.steps) as events:
                result = generate_greedy(runner, prompts, steps + 1, keep_logits=False, overlap=name == "overlap")
            decode_ms[name].append(1e3 * statistics.mean(result.step_seconds[1:]))
            if name == "overlap":
                waited.append(1e3 * (seconds[0] - seconds[1]) / steps)  # the prefill's wait left out
                torch.cuda.synchronize()
                replay = [begin.elapsed_time(end) for begin, end in events]
                period = [a[0].elapsed_time(b[0]) for a, b in itertools.pairwise(events)]
                decode_ms["replay in overlap"].append(statistics.mean(replay))
                decode_ms["between replays"].append(statistics.mean(period) - statistics.mean(replay))
    # one decode batch over `input_len` tokens of KV (slot contents do not matter for timing)
    rows = [runner.req_to_token_pool.alloc() for _ in range(batch_size)]
    context_slots = runner.token_allocator.alloc(batch_size * (input_len + 1))
    try:
        for i, row in enumerate(rows):
            runner.req_to_token_pool.write(row, 0, context_slots[i * (input_len + 1) : (i + 1) * (input_len + 1)])
        new_slots = context_slots.view(batch_size, input_len + 1)[:, -1].contiguous()
        batch = decode_batch(runner, rows, input_len, new_slots)
        graphs = runner.decode_graphs
        padded = graphs.steps.padded_size(batch_size)
        graph = graphs.steps.graphs[padded]

        def forward_and_read() -> None:
            runner.forward(batch).greedy_ids.tolist()

        def replay_and_sync() -> None:
            graph.replay()
            torch.cuda.synchronize()

        forward_and_read()  # loads the batch's inputs into the graph's buffers
        input_ids = graphs.inputs.ids[graphs.inputs.id_names.index("input_ids"), :batch_size]
        greedy_ids = graphs.steps.outputs[padded].greedy_ids[:batch_size]
        pinned = [torch.empty(batch_size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        step_index = [0]

        def overlapped() -> None:
            i = step_index[0] = step_index[0] + 1
            input_ids.copy_(greedy_ids)  # the device feeds itself; the host never waits before a launch
            pinned[i % 2].copy_(greedy_ids, non_blocking=True)
            events[i % 2].record()
            graph.replay()
            events[(i - 1) % 2].synchronize()  # the step before this one is done: read its ids
            pinned[(i - 1) % 2].tolist()

        timings = {"forward+read": [], "replay+sync": [], "replays": [], "overlapped": []}
        for _ in range(repeats):
            timings["forward+read"].append(wall_ms(forward_and_read, steps))
            timings["replay+sync"].append(wall_ms(replay_and_sync, steps))
            timings["replays"].append(replay_ms(graph, steps))
            timings["overlapped"].append(wall_ms(overlapped, steps))
    finally:
        runner.token_allocator.free(context_slots)
        for row in rows:
            runner.req_to_token_pool.free(row)
    result = {"batch_size": batch_size, "waiting": statistics.median(waited)}
    result |= {name: statistics.median(values) for name, values in (decode_ms | timings).items()}
    result["host_share"] = result["serial"] - result["replays"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runner = ModelRunner(ServerArgs.from_cli(args))
    if runner.decode_graphs is None or not runner.decode_graphs.use_graphs:
        raise SystemExit("needs CUDA graphs on a CUDA device")
    for batch_size in tqdm(args.batch_size, desc="Batch sizes", disable=None):
        r = measure(runner, batch_size, args.input_len, args.steps, args.repeats)
        names = ("serial", "overlap", "waiting", "replay in overlap", "between replays", "forward+read")
        names += ("replay+sync", "replays", "overlapped")
        line = ", ".join(f"{name} {r[name]:.3f}" for name in names)
        print(f"batch {batch_size}: ms/step {line}; host share {r['host_share']:.3f}")


if __name__ == "__main__":
    main()
