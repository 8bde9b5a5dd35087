"""Where the host's time goes between a prompt step's read and the next forward call (the GPU idles there).

    PYTHONPATH=. python bench/profile_host_gap.py --model-path gemma-4-E4B-it --load-format dummy \\
        [--decoding 31] [--prompt-len 8192] [--prompts 6]

One scheduler in this process (no server): `--decoding` requests decode while `--prompts` prompts of
`--prompt-len` tokens arrive one at a time, each prefilled in a mixed step beside them (fast-prefill's shape
at concurrency 32). cProfile records only the host's stretch from the start of the scheduler's bookkeeping of a
prompt step (`Scheduler._finish`) to the call of the next forward (`ModelRunner.forward`): what
`bench/step_trace.py` reports as "finish -> ... -> forward". Prints wall ms per prompt step and the top
functions of that stretch.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


def decoding_scheduler(args: argparse.Namespace, count: int) -> Scheduler:
    """A scheduler from the server flags in `args` with `count` requests of 64-token prompts that decode until
    stopped (rids decode-0, decode-1, ...), not stepped yet."""
    scheduler = Scheduler(ServerArgs.from_cli(args))
    vocab = scheduler.runner.model_config.vocab_size
    forever = SamplingParams(temperature=0.0, max_new_tokens=10**6, ignore_eos=True)
    for i in range(count):
        ids = [(13 * j + i) % (vocab - 3) + 3 for j in range(64)]
        scheduler.add_request(TokenizedGenerateReq(rid=f"decode-{i}", input_ids=ids, sampling_params=forever))
    return scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--decoding", type=int, default=31, help="Requests decoding beside the prompts.")
    parser.add_argument("--prompt-len", type=int, default=8192, help="Tokens per arriving prompt.")
    parser.add_argument("--prompts", type=int, default=6, help="Prompts profiled (after one unprofiled).")
    parser.add_argument("--rows", type=int, default=30, help="Functions printed.")
    args = parser.parse_args()
    scheduler = decoding_scheduler(args, args.decoding)
    vocab = scheduler.runner.model_config.vocab_size
    for _ in range(4):
        scheduler.step()

    profile = cProfile.Profile()
    stretches: list[float] = []
    state = {"start": None}
    finish, forward = scheduler._finish, scheduler.runner.forward

    def profiled_finish(launched):
        if launched.batch.items and any(item.num_tokens > 1 for item in launched.batch.items):
            state["start"] = time.perf_counter()
            profile.enable()
        return finish(launched)

    def profiled_forward(batch):
        if state["start"] is not None:
            profile.disable()
            stretches.append(time.perf_counter() - state["start"])
            state["start"] = None
        return forward(batch)

    scheduler._finish, scheduler.runner.forward = profiled_finish, profiled_forward
    one = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    for n in range(args.prompts + 1):
        ids = [(7 * j + n) % (vocab - 3) + 3 for j in range(args.prompt_len)]
        scheduler.add_request(TokenizedGenerateReq(rid=f"prompt-{n}", input_ids=ids, sampling_params=one))
        for _ in range(6):  # its prompt step, the next one, and decode steps
            scheduler.step()
        if n == 0:  # compiles and first-time allocations: not profiled
            profile, stretches[:] = cProfile.Profile(), []
    print("host stretch after a prompt step (ms):", [round(s * 1e3, 2) for s in stretches])
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
