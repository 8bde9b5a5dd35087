"""The overlap schedule (a step launched before the host reads the step before it) changes no output: the
same tokens, logprobs and finish reasons as the serial schedule, with requests finishing at different steps,
arriving mid-decode (their prompt chunks continue the overlap beside the decoding requests), chunked, scored
(max_new_tokens 0), aborted while a step is in flight, and with penalties (recorded on the device, so the
overlap keeps running while the same requests sample).
Also: the server's start-up warm-up leaves the pools as it found them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_scheduler import PRESET, assert_idle_and_consistent, make_scheduler, prompts

from srt.managers.inprocess import GenerationResult
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler_process import warm_up
from srt.sampling.batch_sampler import BatchSampler
from srt.sampling.sampling_params import SamplingParams


def request(rid: int, ids: list[int], **params) -> TokenizedGenerateReq:
    request_keys = ("return_logprob", "top_logprobs_num", "logprob_start_len")
    kwargs = {key: params.pop(key) for key in request_keys if key in params}
    sampling = SamplingParams(**({"temperature": 0.0, "ignore_eos": True} | params))
    return TokenizedGenerateReq(rid=str(rid), input_ids=ids, sampling_params=sampling, **kwargs)


def drive(
    scheduler: Scheduler,
    arrivals: dict[int, list[TokenizedGenerateReq]],
    at_step: Callable[[int], None] | None = None,
    reported: list[tuple[int, str]] | None = None,
) -> dict[str, GenerationResult]:
    """Step to completion, adding arrivals[k] before step k; `at_step(k)` runs before step k too; `reported`
    collects (step, rid) of every output."""
    results: dict[str, GenerationResult] = {}
    step = 0
    while scheduler.has_work() or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            results[req.rid] = GenerationResult()
            scheduler.add_request(req)
        if at_step is not None:
            at_step(step)
        for output in scheduler.step():
            results[output.rid].add(output)
            if reported is not None:
                reported.append((step, output.rid))
        step += 1
    return results


def count_continued(scheduler: Scheduler) -> list[int]:
    """[steps launched before the previous step's tokens were read, of them with prompt tokens] (updated as the
    scheduler runs)."""
    continued = [0, 0]
    original = scheduler._continued

    def spy(previous):
        launch = original(previous)
        continued[0] += launch is not None
        continued[1] += launch is not None and any(not item.decode for item in launch[0].items)
        return launch

    scheduler._continued = spy
    return continued


def mixed_arrivals() -> dict[int, list[TokenizedGenerateReq]]:
    ids = prompts(8, seed=11)
    return {
        0: [
            request(0, ids[0], max_new_tokens=9),
            request(1, ids[1], max_new_tokens=3),
            request(2, ids[2], max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5),
            request(3, ids[3], max_new_tokens=7, return_logprob=True, top_logprobs_num=3),
        ],
        5: [request(4, ids[4], max_new_tokens=6), request(5, ids[5], max_new_tokens=1)],
        9: [request(6, ids[6], max_new_tokens=10, temperature=0.7, seed=9, return_logprob=True)],
    }


def assert_same_results(a: dict[str, GenerationResult], b: dict[str, GenerationResult]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].output_ids == b[rid].output_ids, f"request {rid}"
        assert a[rid].finished_reason == b[rid].finished_reason, f"request {rid}"
        # a finished request's extra row changes the batch's shape, so float32 sums may differ in order
        for x, y in zip(a[rid].output_logprobs, b[rid].output_logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)


def test_overlap_gives_the_serial_outputs(tiny_checkpoint) -> None:
    path = tiny_checkpoint(PRESET)
    serial = make_scheduler(path, disable_overlap_schedule=True)
    expected = drive(serial, mixed_arrivals())
    assert_idle_and_consistent(serial)

    overlapped = make_scheduler(path)
    continued = count_continued(overlapped)
    assert_same_results(drive(overlapped, mixed_arrivals()), expected)
    assert continued[0] >= 5 and continued[1] >= 2  # the overlap did run, prompt steps included
    assert_idle_and_consistent(overlapped)


@pytest.mark.parametrize("radix", [True, False])
def test_prompt_chunks_continue_the_overlap_with_the_serial_outputs(tiny_checkpoint, radix: bool) -> None:
    """Long prompts arrive while others decode and are prefilled in chunks, each chunk launched before the host
    read the step before it; a scored request (max_new_tokens 0, prompt logprobs over chunks) and a shared
    prefix (a cache hit, or not) among them. Every step but the first of each burst continues the overlap."""
    path = tiny_checkpoint(PRESET)
    ids = prompts(6, seed=21, low=40, high=90)
    shared = ids[0][:30] + ids[5]

    def arrivals() -> dict[int, list[TokenizedGenerateReq]]:
        return {
            0: [request(0, ids[0], max_new_tokens=14), request(1, ids[1], max_new_tokens=5)],
            3: [request(2, ids[2], max_new_tokens=6, temperature=0.9, seed=3), request(3, shared, max_new_tokens=4)],
            4: [request(4, ids[4], max_new_tokens=0, return_logprob=True, logprob_start_len=0)],
            6: [request(5, ids[3], max_new_tokens=9, return_logprob=True, top_logprobs_num=2)],
        }

    overrides = {"chunked_prefill_size": 32, "disable_radix_cache": not radix}
    serial = make_scheduler(path, disable_overlap_schedule=True, **overrides)
    expected = drive(serial, arrivals())
    assert_idle_and_consistent(serial)
    scheduler = make_scheduler(path, **overrides)
    continued = count_continued(scheduler)
    got = drive(scheduler, arrivals())
    assert_same_results(got, expected)
    for rid in got:
        assert [t.logprob for t in got[rid].input_logprobs] == pytest.approx(
            [t.logprob for t in expected[rid].input_logprobs], abs=1e-4
        )
    assert continued[1] >= 6  # chunks of every prompt were launched ahead
    assert_idle_and_consistent(scheduler)


def test_penalties_with_a_new_arrival_wait_for_the_host_and_keep_the_serial_outputs(
    tiny_checkpoint, monkeypatch
) -> None:
    """A request with penalties decoding when another arrives: the sampler is rebuilt from the host's token
    history, so that step waits for the host to read the one before it."""
    path = tiny_checkpoint(PRESET)
    ids = prompts(4, seed=22)

    def arrivals() -> dict[int, list[TokenizedGenerateReq]]:
        # strong penalties: a history one token short would let that token come again at once
        penalised = {"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 2.0}
        return {
            0: [request(0, ids[0], max_new_tokens=16, **penalised), request(1, ids[1], max_new_tokens=16)],
            3: [request(2, ids[2], max_new_tokens=6)],
            6: [request(3, ids[3], max_new_tokens=6, min_new_tokens=3)],
        }

    expected = drive(make_scheduler(path, disable_overlap_schedule=True), arrivals())
    scheduler = make_scheduler(path)
    histories = []  # (tokens on the host, tokens computed) of the penalised requests at each sampler build
    build = BatchSampler.build.__func__

    def checked_build(cls, requests, **kwargs):
        owners = {id(req.output_ids): req for req in scheduler.running}
        for sampling in requests:
            if sampling.params.uses_token_history:
                req = owners[id(sampling.output_ids)]
                histories.append((len(req.prompt_ids) + len(req.output_ids), req.kv_len))
        return build(cls, requests, **kwargs)

    monkeypatch.setattr(BatchSampler, "build", classmethod(checked_build))
    assert_same_results(drive(scheduler, arrivals()), expected)
    # random weights seldom let a missing token change the outputs: the history itself must be whole
    assert histories and all(known == computed for known, computed in histories)
    assert_idle_and_consistent(scheduler)


def test_a_stop_token_ends_a_request_one_step_early_with_the_serial_output(tiny_checkpoint) -> None:
    """The request that hits its stop token has already run one more step: that token must not appear."""
    path = tiny_checkpoint(PRESET)
    ids = prompts(2, seed=12)
    probe = drive(make_scheduler(path), {0: [request(0, ids[0], max_new_tokens=10)]})["0"].output_ids
    stop = probe[4]  # the fifth token, or the first earlier occurrence of its value

    def arrivals() -> dict[int, list[TokenizedGenerateReq]]:
        return {0: [request(0, ids[0], max_new_tokens=10, stop_token_ids=[stop]), request(1, ids[1])]}

    serial = drive(make_scheduler(path, disable_overlap_schedule=True), arrivals())
    scheduler = make_scheduler(path)
    overlapped = drive(scheduler, arrivals())
    assert_same_results(overlapped, serial)
    assert overlapped["0"].output_ids[-1] == stop and len(overlapped["0"].output_ids) <= 5
    assert overlapped["0"].finished_reason.kind == "stop"
    assert_idle_and_consistent(scheduler)


def test_penalties_keep_the_overlap(tiny_checkpoint) -> None:
    """Penalties read every earlier token: the sampler records each step's tokens on the device, so a step
    launched before the host read the one before it still sees them, and the outputs are the serial ones."""
    path = tiny_checkpoint(PRESET)
    ids = prompts(3, seed=13)

    def arrivals() -> dict[int, list[TokenizedGenerateReq]]:
        return {
            0: [
                request(0, ids[0], max_new_tokens=8, repetition_penalty=1.3),
                request(1, ids[1], max_new_tokens=8, frequency_penalty=1.5, presence_penalty=0.5),
                request(2, ids[2], max_new_tokens=8),
            ]
        }

    expected = drive(make_scheduler(path, disable_overlap_schedule=True), arrivals())
    scheduler = make_scheduler(path)
    continued = count_continued(scheduler)
    assert_same_results(drive(scheduler, arrivals()), expected)
    assert continued[0] > 0
    assert_idle_and_consistent(scheduler)


@pytest.mark.parametrize("abort_at", [3, 6])
def test_abort_while_a_step_is_in_flight(tiny_checkpoint, abort_at: int) -> None:
    path = tiny_checkpoint(PRESET)
    ids = prompts(3, seed=14)

    def arrivals() -> dict[int, list[TokenizedGenerateReq]]:
        return {0: [request(i, ids[i], max_new_tokens=12) for i in range(3)]}

    expected = drive(make_scheduler(path, disable_overlap_schedule=True), arrivals())
    scheduler = make_scheduler(path)
    aborted: list = []

    def abort_in_flight(step: int) -> None:
        if step == abort_at:
            assert scheduler._in_flight is not None  # a decode step is running ahead
            aborted.append(scheduler.abort("1"))

    reported: list[tuple[int, str]] = []
    results = drive(scheduler, arrivals(), abort_in_flight, reported)
    assert aborted[0] is not None and aborted[0].finished_reason.kind == "abort"
    # nothing reported for the aborted request after its abort (its in-flight token is dropped)
    assert max(step for step, rid in reported if rid == "1") < abort_at
    assert results["1"].finished_reason is None and len(results["1"].output_ids) < 12
    for rid in ("0", "2"):
        assert results[rid].output_ids == expected[rid].output_ids
    assert_idle_and_consistent(scheduler)


def test_server_warm_up_leaves_every_pool_as_it_found_it(tiny_checkpoint) -> None:
    """The GPU server's start-up warm-up (short requests, then long prompts beside a decoding one) runs here on
    the CPU, its long prompts shortened: afterwards nothing is cached, running or in use, and a request gives
    the output of a scheduler that never warmed up."""
    path = tiny_checkpoint(PRESET)
    scheduler = make_scheduler(path)
    full, swa = scheduler.allocator.full.available(), scheduler.allocator.swa.available()
    launched = []
    launch = scheduler._launch
    scheduler._launch = lambda batch, *args: launched.append(batch) or launch(batch, *args)
    warm_up(scheduler, long_prompt=96)
    # the long prompts ran in mixed steps: whole, beside the decoding request's row
    mixed = [[item.num_tokens for item in b.items] for b in launched if max(i.num_tokens for i in b.items) > 64]
    assert mixed == [[1, 96], [1, 95]]
    assert_idle_and_consistent(scheduler)
    assert scheduler.cache.cached() == 0
    assert (scheduler.allocator.full.available(), scheduler.allocator.swa.available()) == (full, swa)
    ids = prompts(1, seed=15)[0]
    got = drive(scheduler, {0: [request(0, ids, max_new_tokens=6)]})
    assert_same_results(got, drive(make_scheduler(path), {0: [request(0, ids, max_new_tokens=6)]}))
