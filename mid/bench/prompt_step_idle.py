"""Does the GPU wait for the host between back-to-back prompt steps? (fast-prefill's waves, #22)

    PYTHONPATH=. python bench/prompt_step_idle.py --model-path gemma-4-E4B-it --load-format dummy \\
        [--decoding 7] [--prompts 6] [--prompt-len 8192] [--trace /tmp/wave.json] [--sync-sites]

One scheduler in this process (no server), the overlap schedule on: `--decoding` requests decode while
`--prompts` prompts of `--prompt-len` tokens arrive at once, so that their prompt steps run back to back, each
with the decoding requests' rows (a wave of fast-prefill at concurrency 8). Printed per prompt step: the host's
wall time between the reads of two consecutive steps' tokens, and, from a torch.profiler trace of the wave, the
device's kernel time and its idle time (no kernel running) over the same stretch. Idle time there is time the
host's launch of the next step did not cover: a read-back inside a launch makes the host wait for the step
before it, and the rest of the launch then runs with the GPU empty.

`--sync-sites` also turns on torch's sync debug mode during the wave and prints each call site in srt that
made the host wait for the device (the stack's innermost srt frame), with counts.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from kernel_timeline import critical_path, kernels_of
from profile_host_gap import decoding_scheduler

from srt.managers.io_struct import TokenizedGenerateReq
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

REPO = str(Path(__file__).resolve().parents[1])
READ_MARK = "prompt_step_idle.read"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--decoding", type=int, default=7, help="Requests decoding beside the prompts.")
    parser.add_argument("--prompts", type=int, default=6, help="Prompts of the timed wave.")
    parser.add_argument("--prompt-len", type=int, default=8192, help="Tokens per prompt.")
    parser.add_argument("--trace", default="/tmp/prompt-wave.json", help="Where the wave's Chrome trace goes.")
    parser.add_argument("--sync-sites", action="store_true", help="List the call sites that wait for the GPU.")
    args = parser.parse_args()
    scheduler = decoding_scheduler(args, args.decoding)
    vocab = scheduler.runner.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)

    def wave(tag: str) -> list[float]:
        """Submit the prompts at once; the host's read times of the steps that carried prompt tokens."""
        for n in range(args.prompts):
            ids = [(7 * j + n + 31 * len(tag)) % (vocab - 3) + 3 for j in range(args.prompt_len)]
            scheduler.add_request(TokenizedGenerateReq(rid=f"{tag}-{n}", input_ids=ids, sampling_params=one))
        reads = []
        while any(r.rid.startswith(tag) for r in scheduler.running) or scheduler.waiting:
            outputs = scheduler.step()
            if any(o.rid.startswith(tag) and o.completion_tokens == 1 and o.new_token_ids for o in outputs):
                reads.append(time.perf_counter())  # the step's tokens were just read: its end on the device
                with torch.profiler.record_function(READ_MARK):  # the same moment on the trace's clock
                    pass
        return reads

    for _ in range(4):
        scheduler.step()
    wave("warm")  # compiles and first-time allocations
    sites: Counter[str] = Counter()
    on_gpu = torch.cuda.is_available()
    if args.sync_sites and on_gpu:
        warnings.showwarning = lambda *a, **k: sites.update([_srt_frame()])
        torch.cuda.set_sync_debug_mode("warn")
    activity = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        reads = wave("timed")
    if args.sync_sites and on_gpu:
        torch.cuda.set_sync_debug_mode(0)
    prof.export_chrome_trace(args.trace)
    report(reads, args.trace)
    for site, count in sites.most_common(30):
        print(f"  waits for the GPU {count:4d}x  {site}")


def report(reads: list[float], trace: str) -> None:
    """Per prompt step (between consecutive first-token reads): host wall ms, device busy and idle ms."""
    windows = busy_and_idle(Path(trace))
    if not windows:  # a CPU run: no kernels, the host's times only
        print("host ms per prompt step:", [round((b - a) * 1e3, 2) for a, b in zip(reads, reads[1:])])
        return
    print(" step   host ms   busy ms   idle ms")
    for i, (busy, idle) in enumerate(windows, 1):
        print(f" {i:4d} {(reads[i] - reads[i - 1]) * 1e3:9.2f} {busy / 1e3:9.2f} {idle / 1e3:9.2f}")


def busy_and_idle(trace: Path) -> list[tuple[float, float]]:
    """(us of kernels on the critical path, us with no kernel running) between consecutive READ_MARKs of a
    torch.profiler trace; [] without kernels."""
    events = json.loads(trace.read_text())["traceEvents"]
    path = critical_path(kernels_of(events))
    if not path:
        return []
    marks = sorted(float(e["ts"]) for e in events if e.get("name") == READ_MARK)
    windows = []
    for lo, hi in zip(marks, marks[1:]):
        busy = sum(exclusive for kernel, exclusive, _ in path if lo <= kernel.start < hi)
        idle = sum(idle for kernel, _, idle in path if lo < kernel.start <= hi)
        windows.append((busy, idle))
    return windows


def _srt_frame() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(REPO) and "prompt_step_idle" not in frame.filename:
            return f"{frame.filename[len(REPO) + 1 :]}:{frame.lineno} {frame.line}"
    return "?"


if __name__ == "__main__":
    main()
