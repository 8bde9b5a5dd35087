"""Continuous batching must not change outputs: batched, chunked, retracted and prefix-cached requests yield
the tokens each request yields alone; every pool and cache is consistent and empty afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4ForCausalLM as ReferenceModel

from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.schedule_batch import Req
from srt.managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

PRESET = "tiny-gemma-4-E4B-it"
NEW_TOKENS = 8


def make_scheduler(path, **overrides) -> Scheduler:
    args = ServerArgs(model_path=str(path), device="cpu", dtype="float32", **overrides)
    return Scheduler(args, ModelRunner(args))


def greedy(rid: str, ids: list[int], max_new_tokens: int = NEW_TOKENS, **kwargs) -> TokenizedGenerateReq:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=params, **kwargs)


def prompts(count: int, seed: int = 0, low: int = 3, high: int = 70) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lens]


def assert_idle_and_consistent(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.req_to_token_pool.in_use() == 0
    assert scheduler.cache.in_use() == 0


@pytest.fixture(scope="module")
def alone_outputs(tiny_checkpoint) -> dict[int, list[int]]:
    """Greedy tokens of each prompt run by itself."""
    scheduler = make_scheduler(tiny_checkpoint(PRESET), disable_radix_cache=True)
    outputs = {}
    for i, ids in enumerate(prompts(16)):
        outputs[i] = run_to_completion(scheduler, [greedy(str(i), ids)])[str(i)].output_ids
    assert_idle_and_consistent(scheduler)
    return outputs


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"chunked_prefill_size": 32},
        {"schedule_policy": "fcfs", "max_prefill_tokens": 100},
        {"disable_radix_cache": True},
    ],
    ids=["batched", "chunked-32", "fcfs-small-prefill-budget", "no-radix-cache"],
)
def test_sixteen_requests_together_match_each_alone(tiny_checkpoint, alone_outputs, overrides) -> None:
    scheduler = make_scheduler(tiny_checkpoint(PRESET), **overrides)
    results = run_to_completion(scheduler, [greedy(str(i), ids) for i, ids in enumerate(prompts(16))])
    for i, expected in alone_outputs.items():
        assert results[str(i)].output_ids == expected, f"request {i}"
    assert_idle_and_consistent(scheduler)


@pytest.mark.parametrize(("mixed", "total_tokens"), [(True, 130), (False, 200)], ids=["mixed", "unmixed"])
def test_retraction_under_a_tiny_kv_budget_keeps_outputs(tiny_checkpoint, alone_outputs, mixed, total_tokens) -> None:
    # 16 prompts of up to 70 tokens + 8 outputs need ~650 slots at once; these budgets force retraction (mixed
    # batches finish decoding requests sooner, so they need a smaller one)
    scheduler = make_scheduler(
        tiny_checkpoint(PRESET),
        max_total_tokens=total_tokens,
        chunked_prefill_size=32,
        disable_mixed_batches=not mixed,
    )
    results = run_to_completion(scheduler, [greedy(str(i), ids) for i, ids in enumerate(prompts(16))])
    assert scheduler.num_retractions > 0
    for i, expected in alone_outputs.items():
        assert results[str(i)].output_ids == expected, f"request {i}"
    assert_idle_and_consistent(scheduler)


def test_shared_prefix_hits_cache_with_same_output(tiny_checkpoint) -> None:
    shared = prompts(1, seed=5, low=60, high=61)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    cached = make_scheduler(tiny_checkpoint(PRESET))
    run_to_completion(cached, [greedy("a", first)])
    hit = run_to_completion(cached, [greedy("b", second)])["b"]
    plain = run_to_completion(make_scheduler(tiny_checkpoint(PRESET), disable_radix_cache=True), [greedy("b", second)])
    assert hit.cached_tokens > 0
    assert plain["b"].cached_tokens == 0
    assert hit.output_ids == plain["b"].output_ids
    assert_idle_and_consistent(cached)


def test_seeded_sampling_reproduces(tiny_checkpoint) -> None:
    params = dict(temperature=1.0, top_p=0.9, max_new_tokens=12, ignore_eos=True)
    ids = prompts(1, seed=3)[0]

    def run(seed: int, neighbours: int) -> list[int]:
        scheduler = make_scheduler(tiny_checkpoint(PRESET))
        requests = [TokenizedGenerateReq("x", ids, SamplingParams(seed=seed, **params))]
        requests += [greedy(f"n{i}", p) for i, p in enumerate(prompts(neighbours, seed=9))]
        out = run_to_completion(scheduler, requests)["x"].output_ids
        assert_idle_and_consistent(scheduler)
        return out

    assert run(7, 0) == run(7, 3)
    assert run(7, 0) != run(8, 0)


def test_logprobs_match_transformers(tiny_checkpoint) -> None:
    path = tiny_checkpoint(PRESET)
    ids = prompts(1, seed=4, low=20, high=21)[0]
    scheduler = make_scheduler(path, chunked_prefill_size=8)
    request = greedy("p", ids, max_new_tokens=4, return_logprob=True, logprob_start_len=3, top_logprobs_num=2)
    result = run_to_completion(scheduler, [request])["p"]

    reference = ReferenceModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    full = ids + result.output_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([full])).logits[0].double(), dim=-1)
    # prompt tokens 3 .. n-1 are scored by rows 2 .. n-2
    assert [lp.token_id for lp in result.input_logprobs] == ids[3:]
    for offset, lp in enumerate(result.input_logprobs):
        row = 2 + offset
        assert lp.logprob == pytest.approx(float(logprobs[row, ids[row + 1]]), abs=1e-4)
        top = torch.topk(logprobs[row], 2)
        assert [t for t, _ in lp.top] == top.indices.tolist()
    for step, lp in enumerate(result.output_logprobs):
        row = len(ids) - 1 + step
        assert lp.token_id == result.output_ids[step]
        assert lp.logprob == pytest.approx(float(logprobs[row, lp.token_id]), abs=1e-4)
    assert_idle_and_consistent(scheduler)


def test_abort_frees_waiting_and_running_requests(tiny_checkpoint) -> None:
    scheduler = make_scheduler(tiny_checkpoint(PRESET), max_running_requests=2)
    for i, ids in enumerate(prompts(4, seed=2)):
        scheduler.add_request(greedy(str(i), ids, max_new_tokens=50))
    scheduler.step()
    scheduler.step()
    assert scheduler.running and scheduler.waiting
    for rid in ("0", "1", "2", "3"):
        output = scheduler.abort(rid)
        assert output is not None and output.finished_reason.kind == "abort"
    assert_idle_and_consistent(scheduler)


def test_bad_requests_are_rejected_with_the_field_named(tiny_checkpoint) -> None:
    scheduler = make_scheduler(tiny_checkpoint(PRESET))
    with pytest.raises(ValueError, match="input_ids"):
        scheduler.add_request(greedy("a", [5, 999999]))
    with pytest.raises(ValueError, match="input_ids"):
        scheduler.add_request(greedy("a", []))
    with pytest.raises(ValueError, match="temperature"):
        scheduler.add_request(TokenizedGenerateReq("a", [5, 6], SamplingParams(temperature=-1.0)))
    with pytest.raises(ValueError, match="logprob_start_len"):
        scheduler.add_request(greedy("a", [5, 6], logprob_start_len=9, return_logprob=True))
    assert_idle_and_consistent(scheduler)


def test_a_request_that_can_never_fit_ends_with_a_reason(tiny_checkpoint) -> None:
    # 12 sliding-window slots cannot hold one 32-token prefill chunk: the request must end, not spin forever
    scheduler = make_scheduler(
        tiny_checkpoint(PRESET), max_total_tokens=64, swa_full_tokens_ratio=0.2, chunked_prefill_size=32
    )
    results = run_to_completion(scheduler, [greedy("big", list(range(3, 43))), greedy("small", [5, 6, 7])])
    assert results["big"].finished_reason.kind == "abort"
    assert "does not fit in KV memory" in results["big"].finished_reason.message
    assert results["small"].finished_reason.kind == "length"
    assert_idle_and_consistent(scheduler)


def test_req_token_slices_equal_slices_of_all_ids() -> None:
    req = Req.from_request(greedy("r", [10, 11, 12, 13]), torch.device("cpu"))
    req.output_ids = [20, 21, 22]
    for start in range(8):
        for stop in range(start, 9):
            assert req.tokens(start, stop) == req.all_ids[start:stop], (start, stop)
    assert req.num_tokens == len(req.all_ids) == 7


@pytest.mark.parametrize("overrides", [{}, {"disable_radix_cache": True}], ids=["radix", "no-radix"])
def test_integrity_holds_after_every_step(tiny_checkpoint, overrides) -> None:
    scheduler = make_scheduler(tiny_checkpoint(PRESET), max_total_tokens=200, chunked_prefill_size=32, **overrides)
    for i, ids in enumerate(prompts(6, seed=11)):
        scheduler.add_request(greedy(str(i), ids))
    while scheduler.has_work():
        scheduler.step()
        scheduler.check_integrity()  # free + cached + running requests' slots == pool, mid-run too
        if scheduler.running and scheduler.allocator.available():
            leaked = scheduler.allocator.alloc(1)  # a slot nobody owns must be noticed while requests run
            with pytest.raises(AssertionError, match="lost slots"):
                scheduler.check_integrity()
            scheduler.allocator.free(leaked)
    assert_idle_and_consistent(scheduler)


@pytest.mark.parametrize("overrides", [{}, {"disable_radix_cache": True}], ids=["radix", "no-radix"])
def test_swa_pool_stats_add_up(tiny_checkpoint, overrides) -> None:
    scheduler = make_scheduler(tiny_checkpoint(PRESET), **overrides)
    scheduler.add_request(greedy("a", prompts(1, seed=6, low=40, high=41)[0], max_new_tokens=30))
    for _ in range(3):
        scheduler.step()
    stats = scheduler.cache.swa_stats()
    assert stats.total == scheduler.allocator.swa_size and stats.free == scheduler.allocator.swa.available()
    assert stats.free + stats.cached + stats.in_use == stats.total
    assert stats.in_use + stats.cached > 0  # the running request's window is held by it or by the cache


def test_flush_cache_drops_every_cached_prefix_only_while_idle(tiny_checkpoint) -> None:
    """/flush_cache's work: the finished requests' prompts leave the cache (full and sliding-window KV back in
    the pools, the pools consistent) and the same prompt then hits nothing; while a request waits nothing is
    dropped."""
    scheduler = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    ids = prompts(2, seed=21, low=30, high=40)
    run_to_completion(scheduler, [greedy(str(i), p) for i, p in enumerate(ids)])
    cached = scheduler.cache.stats().cached
    assert cached > 0
    scheduler.add_request(greedy("waiting", ids[0]))
    assert scheduler.flush_cache() is None and scheduler.cache.stats().cached == cached
    while scheduler.has_work():
        scheduler.step()
    cached = scheduler.cache.stats().cached
    assert scheduler.flush_cache() == cached > 0
    stats, swa = scheduler.cache.stats(), scheduler.cache.swa_stats()
    assert stats.cached == 0 and stats.free == stats.total and swa.free == swa.total
    assert scheduler.cache.match_prefix(ids[0]).prefix_len == 0
    assert_idle_and_consistent(scheduler)
