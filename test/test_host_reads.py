"""A steady decode step and a steady MTP verify round make the host wait for the device once: the copy of the
step's tokens (or accepted counts). Anything else that reads the device (`.tolist()`, a boolean mask, a
pageable copy to the device) would stall a GPU run behind the queued work, the next draft round included.

Counted on the CPU by bench/host_reads.py, on the host path a GPU run takes (the graph steps run eagerly), with
the forwards themselves left out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_scheduler import greedy, make_scheduler, prompts

from srt.managers.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
K = 3


@pytest.fixture
def device_reads(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from host_reads import DeviceReads

    return DeviceReads


def reads_per_steady_step(scheduler: Scheduler, device_reads, steps: int) -> list[dict[str, int]]:
    """The read sites of `steps` steps after every request has its first token (none finishes in them)."""
    scheduler.runner.capture_cuda_graphs(use_graphs=False)  # a GPU run's host path: graph steps, draft ahead
    for i, ids in enumerate(prompts(4, seed=61, low=20, high=40)):
        scheduler.add_request(greedy(str(i), ids, max_new_tokens=(K + 1) * (steps + 3)))
    while any(not req.output_ids for req in scheduler.waiting + scheduler.running):
        scheduler.step()
    scheduler.step()  # the first round drafts on its own; later ones were drafted ahead
    per_step = []
    for _ in range(steps):
        reads = device_reads()
        with reads.counting():
            outputs = scheduler.step()
        assert not any(output.finished_reason for output in outputs)
        per_step.append(dict(reads.sites))
    return per_step


def kinds(sites: dict[str, int]) -> dict[str, int]:
    """{kind: count}: a site is "file:line (kind)"."""
    counts: dict[str, int] = {}
    for site, count in sites.items():
        kind = site[site.index("(") + 1 : -1]
        counts[kind] = counts.get(kind, 0) + count
    return counts


def test_a_verify_round_reads_the_device_once(tiny_checkpoint, device_reads) -> None:
    scheduler = make_scheduler(
        tiny_checkpoint("tiny-gemma-4-E4B-it"),
        speculative_draft_model_path=str(tiny_checkpoint("tiny-gemma-4-E4B-it-assistant")),
        speculative_num_steps=K,
        max_running_requests=4,
    )
    rounds_before = sum(scheduler.spec.accept_counts)
    per_step = reads_per_steady_step(scheduler, device_reads, steps=4)
    assert sum(scheduler.spec.accept_counts) > rounds_before  # the steps were verify rounds
    assert [kinds(sites) for sites in per_step] == [{"wait for DeviceToHost": 1}] * 4, per_step


def test_a_decode_step_reads_the_device_once(tiny_checkpoint, device_reads) -> None:
    scheduler = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"), max_running_requests=4)
    per_step = reads_per_steady_step(scheduler, device_reads, steps=4)
    assert [kinds(sites) for sites in per_step] == [{"wait for DeviceToHost": 1}] * 4, per_step
