"""Speculative decoding (FROZEN_KV_MTP) changes no greedy output and leaks no KV.

With the real tiny assistants (random weights accept almost nothing) and with a drafter that knows the
target's continuation and gets a different number of drafts right for each request and round (so verify
accepts 0 .. K per request in one batch): outputs equal those without MTP, max_tokens and stop tokens land
inside accepted runs, logprobs are the target's, and every pool and cache is consistent after every step,
under chunked prefill, prefix hits, an abort, retraction and a nearly full sliding-window pool.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import transformers
from test_cuda_graph_runner import spy_on_steps
from test_overlap_schedule import drive
from test_scheduler import assert_idle_and_consistent, greedy, make_scheduler, prompts

from srt.layers.attention import triton_backend
from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler_process import warm_up
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.speculative.frozen_kv_mtp import DraftRequests

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = ["E2B", "E4B", "26B-A4B", "31B"]
K = 3


def mtp_scheduler(tiny_checkpoint, variant: str = "E4B", **overrides) -> Scheduler:
    return make_scheduler(
        tiny_checkpoint(f"tiny-gemma-4-{variant}-it"),
        speculative_draft_model_path=str(tiny_checkpoint(f"tiny-gemma-4-{variant}-it-assistant")),
        speculative_num_steps=K,
        **overrides,
    )


def pools_of(runner) -> tuple:
    return runner.req_to_token_pool, runner.kv_pool


def knowing_drafter(scheduler: Scheduler, continuations: dict[str, list[int]], vocab_size: int) -> list[int]:
    """Replace the assistant with drafts from each request's known greedy continuation (prompt + output
    alone), right for a number of leading drafts that varies by request and round; returns the right counts."""
    right_counts = []

    def draft(requests: DraftRequests) -> torch.Tensor:
        by_row = {req.req_pool_idx: req for req in scheduler.running}
        rows = []
        for row, kv_len in zip(requests.req_pool_indices, requests.kv_lens, strict=True):
            req = by_row[row]
            known = continuations[req.rid][kv_len + 1 : kv_len + 1 + K]
            known += [0] * (K - len(known))
            right = (len(req.rid) * 7 + kv_len) % (K + 1)
            right_counts.append(right)
            rows.append(known[:right] + [(t + 1) % vocab_size for t in known[right:]])
        return torch.tensor(rows, dtype=torch.int64, device=scheduler.runner.device)

    scheduler.runner.draft = draft
    scheduler.runner.draft_ahead = lambda *args: None  # every round asks `draft`
    return right_counts


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_outputs_with_the_assistant_equal_those_without(tiny_checkpoint, variant) -> None:
    ids = prompts(3, seed=11, low=5, high=40)
    requests = [greedy(str(i), p, max_new_tokens=9) for i, p in enumerate(ids)]
    plain = make_scheduler(tiny_checkpoint(f"tiny-gemma-4-{variant}-it"))
    expected = {r.rid: run_to_completion(plain, [r])[r.rid].output_ids for r in requests}
    scheduler = mtp_scheduler(tiny_checkpoint, variant)
    alone = run_to_completion(scheduler, requests[:1])
    batched = run_to_completion(scheduler, requests)
    assert alone["0"].output_ids == expected["0"]
    assert {rid: result.output_ids for rid, result in batched.items()} == expected
    # the first token comes from the prefill, the rest from verify rounds (the last with nothing left to draft)
    rounds = batched["0"].spec_verify_ct
    assert 0 < rounds and rounds + batched["0"].spec_accepted_tokens == 8
    assert_idle_and_consistent(scheduler)


def test_server_warm_up_with_the_assistant_leaves_the_pools_empty(tiny_checkpoint) -> None:
    """The start-up warm-up (its long prompts shortened) with speculation on: the decoding request verifies
    drafts beside the long prompts, and nothing is left running, cached or in use."""
    scheduler = mtp_scheduler(tiny_checkpoint)
    full, swa = scheduler.allocator.full.available(), scheduler.allocator.swa.available()
    warm_up(scheduler, long_prompt=96)
    assert_idle_and_consistent(scheduler)
    assert (scheduler.allocator.full.available(), scheduler.allocator.swa.available()) == (full, swa)
    assert sum(scheduler.spec.accept_counts) > 0  # verify rounds ran


def test_different_acceptance_per_request_in_one_batch(tiny_checkpoint, monkeypatch) -> None:
    """Chunks of 8 (mixed with verify rows), a prefix hit, an abort mid-prefill, retraction under a small
    budget and a sliding-window pool at a quarter of the full one; KV indices checked before every kernel."""
    monkeypatch.setenv("SRT_DEBUG_KV_INDICES", "1")
    ids = prompts(6, seed=21, low=20, high=60)
    ids[5] = ids[3][:30] + ids[5][:10]
    lengths = [37, 19, 22, 25, 34, 21]  # max_tokens land inside accepted runs
    requests = [greedy(str(i) * (i + 1), p, max_new_tokens=n) for i, (p, n) in enumerate(zip(ids, lengths))]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"), disable_radix_cache=True)
    expected = {r.rid: run_to_completion(plain, [r])[r.rid].output_ids for r in requests}

    scheduler = mtp_scheduler(tiny_checkpoint, chunked_prefill_size=8, max_total_tokens=100, swa_full_tokens_ratio=0.5)
    continuations = {r.rid: list(r.input_ids) + expected[r.rid] for r in requests}
    right_counts = knowing_drafter(scheduler, continuations, scheduler.runner.model_config.vocab_size)
    doomed = greedy("aborted", prompts(1, seed=5, low=50)[0])
    aborted = []

    def at_step(step: int) -> None:
        scheduler.check_integrity()
        doomed_req = next((req for req in scheduler.running if req.rid == doomed.rid), None)
        if doomed_req is not None and 0 < doomed_req.kv_len < len(doomed.input_ids) and not aborted:
            aborted.append(scheduler.abort(doomed.rid))

    results = drive(scheduler, {0: requests[:2], 2: requests[2:4] + [doomed], 5: requests[4:]}, at_step)
    for request in requests:
        assert results[request.rid].output_ids == expected[request.rid], request.rid
    assert aborted and set(right_counts) == set(range(K + 1))
    accepted = sum(results[r.rid].spec_accepted_tokens for r in requests)
    assert accepted > 0 and sum(scheduler.spec.accept_counts[1:]) > 0
    assert scheduler.num_retractions > 0
    assert_idle_and_consistent(scheduler)


@pytest.mark.parametrize(
    "padded,together", [(False, True), (True, True), (True, False)], ids=["eager", "padded", "padded_row_by_row"]
)
def test_triton_verify_steps_keep_the_outputs(tiny_checkpoint, padded: bool, together: bool, monkeypatch) -> None:
    """The Triton backend (interpreted on CPU) runs verify steps with the verify kernel, each request's K + 1 rows
    together over its prefix (or, below VERIFY_KERNEL_MIN_REQUESTS requests, the decode kernel row by row), as
    laid out by the scheduler and as the verify graphs pad them (every token a logits row, through every layer):
    the outputs of the reference backend without MTP."""
    monkeypatch.setattr(triton_backend, "VERIFY_KERNEL_MIN_REQUESTS", 1 if together else 100)
    ids = prompts(2, seed=51, low=18, high=30)
    requests = [greedy(str(i), p, max_new_tokens=7) for i, p in enumerate(ids)]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    expected = {r.rid: run_to_completion(plain, [r])[r.rid].output_ids for r in requests}
    scheduler = mtp_scheduler(tiny_checkpoint, attention_backend="triton", max_running_requests=4)
    if padded:
        scheduler.runner.capture_cuda_graphs(use_graphs=False)
    continuations = {r.rid: list(r.input_ids) + expected[r.rid] for r in requests}
    knowing_drafter(scheduler, continuations, scheduler.runner.model_config.vocab_size)
    verify_rows = []
    init = scheduler.runner.attn_backend.init_forward_metadata

    def spy(batch) -> None:
        init(batch)
        if batch.verify_rows:
            verify_rows.append(batch.verify_rows)
            assert batch.attn_metadata.verify_rows == (batch.verify_rows if together else 0)

    scheduler.runner.attn_backend.init_forward_metadata = spy
    results = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in results.items()} == expected
    # K + 1 rows, fewer where max_new_tokens leaves fewer drafts to verify
    assert K + 1 in verify_rows and set(verify_rows) <= set(range(2, K + 2))
    assert_idle_and_consistent(scheduler)


def test_stop_tokens_inside_an_accepted_run_end_the_request_there(tiny_checkpoint) -> None:
    prompt = prompts(1, seed=8, low=10, high=11)[0]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    full = run_to_completion(plain, [greedy("r", prompt, max_new_tokens=12)])["r"].output_ids
    stop = full[6]
    expected = full[: full.index(stop) + 1]
    scheduler = mtp_scheduler(tiny_checkpoint)
    knowing_drafter(scheduler, {"r": prompt + full}, scheduler.runner.model_config.vocab_size)
    assert run_to_completion(scheduler, [greedy("r", prompt, max_new_tokens=12)])["r"].output_ids == full
    request = greedy("s", prompt, max_new_tokens=12)
    request.sampling_params.stop_token_ids = [stop]
    knowing_drafter(scheduler, {"s": prompt + full}, scheduler.runner.model_config.vocab_size)
    result = run_to_completion(scheduler, [request])["s"]
    assert result.output_ids == expected and result.finished_reason.kind == "stop"
    assert_idle_and_consistent(scheduler)


def test_a_logit_bias_request_decodes_one_token_at_a_time_beside_speculating_ones(tiny_checkpoint) -> None:
    """A biased request does not verify drafts (only the sampler applies its bias): with MTP its tokens, and its
    neighbour's, are those without MTP."""
    ids = prompts(2, seed=12, low=8, high=20)
    biased = greedy("b", ids[0], max_new_tokens=8)
    biased.sampling_params.logit_bias = {"7": 3.0, "11": -100.0}
    requests = [biased, greedy("p", ids[1], max_new_tokens=8)]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    expected = {rid: result.output_ids for rid, result in run_to_completion(plain, requests).items()}
    assert 11 not in expected["b"]
    scheduler = mtp_scheduler(tiny_checkpoint)
    results = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in results.items()} == expected
    assert results["b"].spec_verify_ct == 0 and results["p"].spec_verify_ct > 0
    assert_idle_and_consistent(scheduler)


def test_logprobs_with_mtp_are_the_targets(tiny_checkpoint) -> None:
    prompt = prompts(1, seed=9, low=12, high=13)[0]
    request = greedy("lp", prompt, max_new_tokens=10, return_logprob=True, top_logprobs_num=3)
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    expected = run_to_completion(plain, [request])["lp"]
    scheduler = mtp_scheduler(tiny_checkpoint)
    knowing_drafter(scheduler, {"lp": prompt + expected.output_ids}, scheduler.runner.model_config.vocab_size)
    result = run_to_completion(scheduler, [request])["lp"]
    assert result.output_ids == expected.output_ids and result.spec_accepted_tokens > 0
    for got, want in zip(result.output_logprobs, expected.output_logprobs, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert_idle_and_consistent(scheduler)


def test_sampling_with_mtp_keeps_the_targets_distribution(tiny_checkpoint) -> None:
    """Temperature 1, top-k 3: the first two tokens of 600 requests, the second from a verify round whose draft
    is the target's likeliest token (accepted with probability p(d), else the residual is drawn), against the
    target's exact distribution of the 9 pairs: a chi-square test at p = 0.001 (8 degrees of freedom)."""
    prompt = prompts(1, seed=12, low=8, high=9)[0]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))

    def top3(ids: list[int]) -> dict[int, float]:
        request = greedy("p", ids, max_new_tokens=1, return_logprob=True, top_logprobs_num=3)
        top = run_to_completion(plain, [request])["p"].output_logprobs[0].top
        weights = {token: math.exp(logprob) for token, logprob in top}
        return {token: weight / sum(weights.values()) for token, weight in weights.items()}

    first = top3(prompt)
    second = {t1: top3(prompt + [t1]) for t1 in first}
    exact = {(t1, t2): p1 * p2 for t1, p1 in first.items() for t2, p2 in second[t1].items()}
    likeliest = {t1: max(probs, key=probs.get) for t1, probs in second.items()}

    scheduler = mtp_scheduler(tiny_checkpoint, max_running_requests=300)
    scheduler.runner.draft = lambda requests: torch.tensor(
        [[likeliest[t1]] * K for t1 in requests.last_token_ids.tolist()], dtype=torch.int64
    )
    scheduler.runner.draft_ahead = lambda *args: None
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True)
    requests = [TokenizedGenerateReq(str(i), prompt, params) for i in range(600)]
    results = run_to_completion(scheduler, requests)
    pairs = Counter(tuple(result.output_ids[:2]) for result in results.values())
    assert set(pairs) <= set(exact)
    assert sum(result.spec_accepted_tokens for result in results.values()) > 100  # both branches ran
    chi2 = sum((pairs[pair] - 600 * p) ** 2 / (600 * p) for pair, p in exact.items())
    assert chi2 < 26.12, (chi2, pairs, exact)
    assert_idle_and_consistent(scheduler)


def transformers_assisted(target_dir, assistant_dir, prompt: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    """transformers' assisted generation with the assistant (K drafts a round, constant): the output ids and the
    number of target forwards after the prefill."""
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = K
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    forwards = []
    target.register_forward_hook(lambda *_: forwards.append(1))
    ids = torch.tensor([prompt])
    out = target.generate(ids, assistant_model=assistant, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist(), len(forwards) - 1


def test_verify_rounds_equal_transformers_target_forwards(tiny_checkpoint) -> None:
    """transformers drafts its first round from the prompt's first hidden state and later ones over the
    rejected draft's KV, so its drafts differ from srt's (which follow its candidate generator from a
    consistent state, test_mtp_drafter.py); random weights accept neither, and the round counts agree."""
    target_dir = tiny_checkpoint("tiny-gemma-4-E4B-it")
    assistant_dir = tiny_checkpoint("tiny-gemma-4-E4B-it-assistant")
    scheduler = mtp_scheduler(tiny_checkpoint)
    for i, prompt in enumerate(prompts(2, seed=14, low=6, high=30)):
        expected, forwards = transformers_assisted(target_dir, assistant_dir, prompt, 12)
        result = run_to_completion(scheduler, [greedy(str(i), prompt, max_new_tokens=12)])[str(i)]
        assert result.output_ids == expected
        assert result.spec_verify_ct == forwards
    assert_idle_and_consistent(scheduler)


def test_padded_draft_and_verify_steps_change_nothing(tiny_checkpoint) -> None:
    """The steps the CUDA graphs capture, run eagerly on CPU: a draft round of 3 requests padded to 4 drafts
    what the plain drafter does, and verify steps replayed at padded token counts keep every output."""
    ids = prompts(3, seed=31, low=10, high=40)
    requests = [greedy(str(i), p, max_new_tokens=14) for i, p in enumerate(ids)]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    expected = {r.rid: run_to_completion(plain, [r])[r.rid].output_ids for r in requests}

    scheduler = mtp_scheduler(tiny_checkpoint, max_running_requests=4)
    runner = scheduler.runner
    runner.capture_cuda_graphs(use_graphs=False)
    rounds: list[tuple[torch.Tensor, torch.Tensor]] = []
    padded_draft = runner.draft

    def draft_both_ways(requests: DraftRequests) -> torch.Tensor:
        plain_drafts = runner.drafter.draft(requests, *pools_of(runner), runner.attn_backend)
        drafts = padded_draft(requests)
        rounds.append((drafts.clone(), plain_drafts))
        return drafts

    runner.draft = draft_both_ways
    ahead = []
    draft_ahead = runner.draft_ahead

    def draft_ahead_both_ways(newest, hidden, kv_lens, rows):
        drafts = draft_ahead(newest, hidden, kv_lens, rows)
        plain = DraftRequests(newest, hidden, kv_lens.tolist(), rows.tolist())
        ahead.append(torch.equal(drafts, runner.drafter.draft(plain, *pools_of(runner), runner.attn_backend)))
        return drafts

    runner.draft_ahead = draft_ahead_both_ways
    verify_tokens: list[int] = []
    spy_on_steps(runner.verify_graphs.steps, verify_tokens)
    results = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in results.items()} == expected
    assert any(len(drafts) == 3 for drafts, _ in rounds)
    assert all(torch.equal(padded, plain) for padded, plain in rounds)
    assert ahead and all(ahead)  # each verify step drafted the next round before the host read it
    assert 4 * (K + 1) in verify_tokens  # 3 requests verify in the step of 4
    assert_idle_and_consistent(scheduler)


def test_prompt_chunks_beside_verify_items_take_padded_token_steps(tiny_checkpoint) -> None:
    """A prompt chunk beside speculating requests (K + 1 logits rows each: more logits rows than
    --max-running-requests in all) takes a padded token-count step, as the GPU replays it, not an eager forward
    (launch-bound on a GPU); every request gives the tokens it gives without MTP."""
    ids = prompts(4, seed=5, low=20, high=60)
    requests = [greedy(str(i), p, max_new_tokens=10) for i, p in enumerate(ids)]
    plain = make_scheduler(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    expected = {r.rid: run_to_completion(plain, [r])[r.rid].output_ids for r in requests}

    scheduler = mtp_scheduler(tiny_checkpoint, max_running_requests=4, chunked_prefill_size=16)
    scheduler.runner.capture_cuda_graphs(use_graphs=False)
    graphs = scheduler.runner.extend_graphs
    wide_steps: list[bool] = []  # per step with prompt tokens and more logits rows than requests: padded?
    can_run = graphs.can_run

    def recording_can_run(batch) -> bool:
        padded = can_run(batch)
        if not batch.verify_rows and batch.num_tokens > len(batch.logits_rows_cpu) > 4:
            wide_steps.append(padded)
        return padded

    graphs.can_run = recording_can_run
    results = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in results.items()} == expected
    assert wide_steps and all(wide_steps), wide_steps
    assert_idle_and_consistent(scheduler)


# ---- GPU: real graphs ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_captured_draft_and_verify_steps_keep_greedy_outputs(tiny_checkpoint, variant) -> None:
    """Captured draft rounds and verify steps (the knowing drafter for acceptance, then the real assistant):
    the greedy outputs of the target alone."""
    ids = prompts(5, seed=41, low=10, high=60)
    requests = [greedy(str(i), p, max_new_tokens=20) for i, p in enumerate(ids)]
    target = str(tiny_checkpoint(f"tiny-gemma-4-{variant}-it"))
    common = dict(model_path=target, device="cuda", dtype="float32", max_running_requests=8, max_total_tokens=4096)
    plain = Scheduler(ServerArgs(**common))
    expected = {r.rid: run_to_completion(plain, [r])[r.rid].output_ids for r in requests}
    del plain
    assistant = str(tiny_checkpoint(f"tiny-gemma-4-{variant}-it-assistant"))
    scheduler = Scheduler(ServerArgs(**common, speculative_draft_model_path=assistant, speculative_num_steps=K))
    runner = scheduler.runner
    assert runner.draft_graphs.steps.use_graphs and runner.verify_graphs.steps.use_graphs
    verify_tokens: list[int] = []
    spy_on_steps(runner.verify_graphs.steps, verify_tokens)
    results = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in results.items()} == expected
    continuations = {r.rid: list(r.input_ids) + expected[r.rid] for r in requests}
    knowing_drafter(scheduler, continuations, runner.model_config.vocab_size)
    results = run_to_completion(scheduler, requests)
    assert {rid: result.output_ids for rid, result in results.items()} == expected
    assert sum(result.spec_accepted_tokens for result in results.values()) > 0
    assert verify_tokens
    assert_idle_and_consistent(scheduler)
