"""Mixed batches (a step carries every decoding request's next token beside prompt chunks) change no output:
the tokens each request gives alone, with long prompts arriving while others decode, chunks that split sliding
windows, prefix hits, an abort mid-prefill and retraction; every pool and cache is consistent after every
step. And a decoding request gets a token in every step of another request's chunked prefill."""

from __future__ import annotations

import pytest
from test_overlap_schedule import drive
from test_scheduler import PRESET, assert_idle_and_consistent, greedy, make_scheduler, prompts

from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler

CHUNK = 8  # tokens: the tiny presets' sliding window is 16, so chunks split windows


def token_steps(scheduler: Scheduler, decoding: TokenizedGenerateReq, prompt: TokenizedGenerateReq) -> list[int]:
    """Steps at which `decoding` got tokens, from the step `prompt` arrives (while it decodes) to its end."""
    scheduler.add_request(decoding)
    while not any(output.new_token_ids for output in scheduler.step()):  # its prompt, then its first token
        pass
    scheduler.add_request(prompt)
    steps, step = [], 0
    while scheduler.has_work():
        for output in scheduler.step():
            if output.rid == decoding.rid and output.new_token_ids:
                steps.append(step)
        step += 1
    return steps


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "unmixed"])
def test_a_decoding_request_waits_one_step_at_most_during_a_chunked_prefill(tiny_checkpoint, mixed: bool) -> None:
    path = tiny_checkpoint(PRESET)
    short, long = prompts(1, seed=3, low=5, high=6)[0], prompts(1, seed=4, low=64, high=65)[0]
    scheduler = make_scheduler(
        path, chunked_prefill_size=CHUNK, disable_overlap_schedule=True, disable_mixed_batches=not mixed
    )
    steps = token_steps(scheduler, greedy("d", short, max_new_tokens=24), greedy("p", long, max_new_tokens=2))
    gaps = [b - a for a, b in zip([-1, *steps], steps)]
    if mixed:
        assert max(gaps) == 1  # a token in every step, the 8 prefill chunks included
    else:
        assert max(gaps) >= 64 // CHUNK  # it waits for every chunk
    assert_idle_and_consistent(scheduler)


def test_a_mixed_workload_gives_each_requests_tokens_alone(tiny_checkpoint) -> None:
    """Requests arriving while others decode, long ones in chunks of 8, two sharing a prefix (a hit), one
    aborted in the middle of its prefill, under a KV budget that forces retraction."""
    path = tiny_checkpoint(PRESET)
    ids = prompts(6, seed=21, low=20, high=70)
    ids[5] = ids[3][:40] + ids[5][:10]  # a prefix hit on request 3's prompt
    requests = [greedy(str(i), p, max_new_tokens=10) for i, p in enumerate(ids)]
    alone_scheduler = make_scheduler(path, disable_radix_cache=True)
    alone = {r.rid: run_to_completion(alone_scheduler, [r])[r.rid].output_ids for r in requests}

    scheduler = make_scheduler(path, chunked_prefill_size=CHUNK, max_total_tokens=100)
    doomed = greedy("aborted", prompts(1, seed=5, low=60)[0])
    arrivals = {0: requests[:2], 3: requests[2:4], 9: [doomed], 12: requests[4:]}
    aborted = []

    def at_step(step: int) -> None:
        scheduler.check_integrity()
        running = {req.rid: req for req in scheduler.running}
        doomed_req = running.get(doomed.rid)
        if doomed_req is not None and 0 < doomed_req.kv_len < len(doomed.input_ids) and not aborted:
            aborted.append(scheduler.abort(doomed.rid))  # part-way through its chunks

    results = drive(scheduler, arrivals, at_step)
    scheduler.check_integrity()
    for request in requests:
        assert results[request.rid].output_ids == alone[request.rid], request.rid
    assert aborted and aborted[0].finished_reason.kind == "abort"
    assert scheduler.num_retractions > 0
    assert_idle_and_consistent(scheduler)
