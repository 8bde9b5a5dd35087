"""On a GPU the scheduler's host waits for the device only where it reads a step's tokens.

Every other copy between host and device is pinned and queued, so the host prepares the next step while the GPU
runs this one (the overlap schedule), and a prefill's forward is launched whole (YOCO's logits rows are taken
in its middle). A pageable copy (`torch.tensor(values, device="cuda")`, `tensor[index] = 0`, a GPU tensor indexed
by a Python list), `.item()` or a boolean mask's count would make the host wait for everything queued before
it: PyTorch's sync debug mode raises at each of them. With the radix cache on, the second run's prompts hit
the first run's prefixes, and caching and eviction take which tokens hold sliding-window KV from the host.
"""

from __future__ import annotations

import pytest
import torch
from test_overlap_schedule import drive, request
from test_scheduler import PRESET, assert_idle_and_consistent, prompts

from srt.forward.host_device import DeviceToHost
from srt.managers.scheduler import Scheduler
from srt.server_args import ServerArgs


def arrivals() -> dict:
    """Prompts in chunks beside decoding requests, finishing at different steps; greedy, seeded sampling,
    penalties and min_new_tokens (the samplers built as the batch changes)."""
    ids = prompts(6, seed=3, low=20, high=90)
    return {
        0: [request(0, ids[0], max_new_tokens=12), request(1, ids[1], max_new_tokens=4)],
        3: [request(2, ids[2], max_new_tokens=9, temperature=0.8, top_p=0.9, seed=5)],
        6: [
            request(3, ids[3], max_new_tokens=7, repetition_penalty=1.3, frequency_penalty=0.5),
            request(4, ids[4], max_new_tokens=6, min_new_tokens=3, temperature=0.7, seed=2),
        ],
        10: [request(5, ids[5], max_new_tokens=8)],
    }


@pytest.mark.gpu
@pytest.mark.parametrize("radix", [False, True], ids=["chunk-cache", "radix"])
@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "mtp"])
def test_steps_wait_for_the_device_only_to_read_tokens(
    tiny_checkpoint, monkeypatch, drafting: bool, radix: bool
) -> None:
    extra = {}
    if drafting:
        extra = {"speculative_draft_model_path": str(tiny_checkpoint(f"{PRESET}-assistant"))}
    args = ServerArgs(
        model_path=str(tiny_checkpoint(PRESET)), device="cuda", dtype="bfloat16", disable_radix_cache=not radix,
        chunked_prefill_size=32, max_total_tokens=4096, **extra,
    )  # fmt: skip
    scheduler = Scheduler(args)
    drive(scheduler, arrivals())  # first launches compile kernels (Triton may wait then)
    assert_idle_and_consistent(scheduler)

    read = DeviceToHost.get

    def intended_read(copy: DeviceToHost) -> list[torch.Tensor]:
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(copy)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(DeviceToHost, "get", intended_read)
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = drive(scheduler, arrivals())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [len(results[str(i)].output_ids) for i in range(6)] == [12, 4, 9, 7, 6, 8]
    assert_idle_and_consistent(scheduler)
