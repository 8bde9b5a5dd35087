"""Host (CPU, Python) time of an MTP round and of a plain decode step, the model's forwards left out.

A round (FROZEN_KV_MTP) on a GPU is a draft round and a verify step replayed as CUDA graphs, plus the host's
bookkeeping around them: scheduling, the acceptance read-back, appends, the KV give-back of rejected rows, the
next step's layout. This runs the scheduler on a tiny target + tiny assistant (dummy weights, so verify can
accept a simulated mean: SRT_SIMULATE_ACCEPT_LEN, 2.5 unless set) with the graph steps run eagerly
(`capture_cuda_graphs(use_graphs=False)`: the host path of a GPU run), and subtracts the time spent inside the
captured steps (`CapturedSteps.run`, a replay on a GPU). Reported:

    host ms per round          CPU time of the decode steps minus the steps' forwards, per verify round (the
                               thread's CPU time, not wall time: other processes on the machine do not count)
    host ms per plain step     the same for plain decode (drafting off, overlap schedule)
    device reads per round     call sites that make a GPU host wait (bench/host_reads.py)
    --profile                  cProfile of the host code alone (the profiler is off inside the forwards)

    python bench/profile_verify_round.py --batch-size 32 --repeats 3 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
import zlib
from collections.abc import Callable

import torch
from host_reads import DeviceReads

from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.model_executor.captured_steps import CapturedSteps
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


class ForwardClock:
    """Seconds spent inside `CapturedSteps.run` (the forwards) while installed; `on_enter`/`on_exit` run around
    each forward (a profiler paused for it)."""

    def __init__(self, on_enter: Callable[[], None] | None = None, on_exit: Callable[[], None] | None = None):
        self.seconds = 0.0
        self.calls = 0
        self._original = CapturedSteps.run
        clock = self

        def run(steps, batch_size):
            if on_enter:
                on_enter()
            start = time.thread_time()
            try:
                return clock._original(steps, batch_size)
            finally:
                clock.seconds += time.thread_time() - start
                clock.calls += 1
                if on_exit:
                    on_exit()

        CapturedSteps.run = run

    def remove(self) -> None:
        CapturedSteps.run = self._original


def build_scheduler(args: argparse.Namespace) -> Scheduler:
    server_args = ServerArgs(
        model_path=f"tiny-gemma-4-{args.variant}-it",
        speculative_draft_model_path=f"tiny-gemma-4-{args.variant}-it-assistant",
        speculative_num_steps=args.num_steps,
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_running_requests=args.batch_size,
        # room for every run's prompts in the prefix cache: no eviction while a run decodes
        max_total_tokens=8 * args.batch_size * (args.input_len + args.output_len + 2 * args.num_steps),
    )
    scheduler = Scheduler(server_args)
    if not args.no_graph_steps:
        scheduler.runner.capture_cuda_graphs(use_graphs=False)  # the GPU's host path: draft ahead, padded steps
    return scheduler


def add_requests(scheduler: Scheduler, args: argparse.Namespace, tag: str) -> None:
    # prompts of their own per run: no prefix hits on an earlier run's prompts
    generator = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    vocab = scheduler.runner.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True)
    for i in range(args.batch_size):
        ids = torch.randint(3, vocab, (args.input_len,), generator=generator).tolist()
        scheduler.add_request(TokenizedGenerateReq(f"{tag}-{i}", ids, params))


def prefill(scheduler: Scheduler, batch_size: int) -> None:
    """Step until every request has its first token (the prefill is not what is measured)."""
    started: set[str] = set()
    while len(started) < batch_size:
        started.update(out.rid for out in scheduler.step() if out.new_token_ids)


def run_decode(scheduler: Scheduler, args: argparse.Namespace, mtp: bool, tag: str, hooks: dict) -> dict:
    """One batch decoded to the end; host seconds (wall minus forwards) per round / step."""
    spec = scheduler.spec
    scheduler.spec = spec if mtp else None
    try:
        # an empty prefix cache: no run evicts an earlier run's prompts while it decodes
        scheduler.cache.evict(scheduler.allocator.full_size)
        add_requests(scheduler, args, tag)
        prefill(scheduler, args.batch_size)
        clock = ForwardClock(hooks.get("enter"), hooks.get("exit"))
        steps = 0
        start = time.thread_time()
        try:
            if hooks.get("start"):
                hooks["start"]()
            while scheduler.has_work():
                scheduler.step()
                steps += 1
            if hooks.get("stop"):
                hooks["stop"]()
        finally:
            clock.remove()
        seconds = time.thread_time() - start
    finally:
        scheduler.spec = spec
    scheduler.check_integrity()
    rounds = steps  # at one batch every step is a verify step (or, without MTP, a decode step)
    host = seconds - clock.seconds
    per_round = {"host_ms": host / rounds * 1e3, "forward_ms": clock.seconds / rounds * 1e3}
    return {"rounds": rounds, "steps": steps, **per_round}


def count_reads(scheduler: Scheduler, args: argparse.Namespace, mtp: bool) -> tuple[DeviceReads, int]:
    reads = DeviceReads()
    counter = reads.counting()
    result = run_decode(scheduler, args, mtp, f"reads-{mtp}", {"start": counter.__enter__, "stop": _exit(counter)})
    return reads, result["rounds"]


def _exit(context) -> Callable[[], None]:
    return lambda: context.__exit__(None, None, None)


def profile(scheduler: Scheduler, args: argparse.Namespace, mtp: bool) -> str:
    profiler = cProfile.Profile()
    hooks = {"start": profiler.enable, "stop": profiler.disable, "enter": profiler.disable, "exit": profiler.enable}
    result = run_decode(scheduler, args, mtp, f"profile-{mtp}", hooks)
    rounds = result["rounds"]
    entries = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, calls, own s, cumulative s, callers)
    lines = [f"cProfile of the host code, {'MTP round' if mtp else 'plain step'} ({rounds}), ms per round:"]
    for title, column in (("cumulative", 3), ("own", 2)):
        lines.append(f"  by {title} time:      cumulative  own    calls")
        top = sorted(entries.items(), key=lambda item: item[1][column], reverse=True)[: args.top]
        for (file, line, name), (_, calls, own, cumulative, _) in top:
            where = f"{os.path.relpath(file)}:{line}({name})" if line else name
            ms = f"{cumulative / rounds * 1e3:8.3f} {own / rounds * 1e3:8.3f}"
            lines.append(f"    {ms} {calls / rounds:8.1f}  {where}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="E4B")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs of each mode, alternated.")
    parser.add_argument("--no-graph-steps", action="store_true", help="Plain eager forwards (no draft ahead).")
    parser.add_argument("--profile", action="store_true", help="Print a cProfile of the host code.")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("SRT_SIMULATE_ACCEPT_LEN", "2.5")
    torch.set_num_threads(1)
    scheduler = build_scheduler(args)
    for mtp in (False, True):  # warm-up
        run_decode(scheduler, args, mtp, f"warm-{mtp}", {})
    times: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for mtp in (False, True):
            result = run_decode(scheduler, args, mtp, f"timed-{repeat}-{mtp}", {})
            times[mtp].append(result["host_ms"])
            name = "MTP round " if mtp else "plain step"
            print(
                f"{name}: host {result['host_ms']:.3f} ms, forwards {result['forward_ms']:.3f} ms "
                f"({result['rounds']} rounds, {result['steps']} steps)"
            )
    for mtp in (False, True):
        name = "MTP round " if mtp else "plain step"
        print(f"median host ms per {name}: {statistics.median(times[mtp]):.3f} (batch {args.batch_size})")
    for mtp in (False, True):
        reads, rounds = count_reads(scheduler, args, mtp)
        name = "MTP round" if mtp else "plain step"
        print(f"device reads per {name}: {reads.total / rounds:.2f}")
        for site, count in reads.sites.most_common():
            print(f"    {count / rounds:6.2f}  {site}")
    if args.profile:
        for mtp in (False, True):
            print(profile(scheduler, args, mtp))


if __name__ == "__main__":
    main()
