"""Batched sampler against independent references: torch.argmax, softmax(logits / T) restricted by hand,
hand-computed penalties, torch.log_softmax of the raw logits."""

from __future__ import annotations

import pytest
import torch

from srt.sampling import SamplingParams
from srt.sampling.batch_sampler import BatchSampler, RequestSampling
from srt.sampling.sampler import (
    PenaltyState,
    SamplingBatch,
    apply_penalties,
    logprobs_of,
    make_generator,
    sample,
    top_logprobs,
)

CPU = torch.device("cpu")
EOS = 1


def _batch(params: list[SamplingParams], vocab: int, device: torch.device = CPU, **kwargs) -> SamplingBatch:
    return SamplingBatch.build(params, vocab_size=vocab, device=device, eos_token_ids=[EOS], **kwargs)


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row: n copies of it in one batch, rows sharing a seeded default generator."""
    batch = _batch([params] * n, logits_row.numel(), default_generator=make_generator(seed, CPU))
    return sample(logits_row.expand(n, -1).contiguous(), batch, return_logprob=False).next_token_ids


def _chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of draws `ids` against `probs`; tokens of probability 0 must never be drawn."""
    observed = torch.bincount(ids, minlength=probs.numel()).double()
    expected = probs.double() * ids.numel()
    assert observed[expected == 0].sum() == 0, "drew a token the filters should have removed"
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Distinct, well separated logits so filters cut at unambiguous places.
LOGITS = torch.tensor([2.0, 0.5, 1.5, -1.0, 1.0, 0.0, -0.5, 3.0])
CHI2_LIMIT = 30.0  # about the 99.99% quantile of chi-square with 7 degrees of freedom


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0
    out = sample(logits, _batch([SamplingParams(temperature=0)] * 5, 50))
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
    assert out.next_token_ids[2] == 7


def test_greedy_rows_take_the_callers_argmax_unless_penalised() -> None:
    """`greedy_ids` (the logits kernel's argmax) stands in for the greedy rows' own argmax; ids that are not the
    argmax show which one was used."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    given = torch.tensor([3, 4, 5, 6])
    greedy = _batch([SamplingParams(temperature=0)] * 4, 50)
    assert sample(logits, greedy, greedy_ids=given).next_token_ids.tolist() == [3, 4, 5, 6]
    mixed = _batch([SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2, 50)
    assert sample(logits, mixed, greedy_ids=given).next_token_ids[::2].tolist() == [3, 5]
    # penalties change the logits the argmax is over: the given ids no longer apply
    params = [SamplingParams(temperature=0, frequency_penalty=0.5)] * 4
    penalised = _batch(params, 50)
    state = PenaltyState.build(penalised, [[0]] * 4, [[]] * 4)
    ids = sample(logits, penalised, state, greedy_ids=given).next_token_ids
    assert torch.equal(ids, torch.argmax(logits, dim=-1))


def test_temperature_to_zero_and_top_k_one_match_greedy() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1e-3)] * 8 + [SamplingParams(temperature=1.5, top_k=1)] * 8
    out = sample(logits, _batch(params, 100, default_generator=make_generator(0, CPU)))
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))


def test_tiny_top_p_takes_argmax() -> None:
    ids = _draws(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6), n=200)
    assert (ids == 7).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax_over_temperature(temperature: float) -> None:
    ids = _draws(LOGITS, SamplingParams(temperature=temperature), n=20000)
    assert _chi_square(ids, torch.softmax(LOGITS / temperature, dim=-1)) < CHI2_LIMIT


def test_top_k_top_p_min_p_renormalise_the_kept_tokens() -> None:
    by_rank = [7, 0, 2, 4, 1, 5, 6, 3]  # token ids of LOGITS, most likely first

    def restricted(keep: list[int], temperature: float) -> torch.Tensor:
        probs = torch.zeros_like(LOGITS)
        probs[keep] = torch.softmax(LOGITS[keep] / temperature, dim=-1)
        return probs

    # top_k=3 keeps the three largest logits.
    ids = _draws(LOGITS, SamplingParams(temperature=0.8, top_k=3), n=20000)
    assert _chi_square(ids, restricted(by_rank[:3], 0.8)) < CHI2_LIMIT
    # top_p: the smallest prefix whose mass reaches top_p; computed here from the full softmax.
    full = torch.softmax(LOGITS, dim=-1)
    mass = full[by_rank].cumsum(0)
    n_keep = int((mass < 0.8).sum()) + 1
    ids = _draws(LOGITS, SamplingParams(top_p=0.8), n=20000)
    assert _chi_square(ids, restricted(by_rank[:n_keep], 1.0)) < CHI2_LIMIT
    # top_p is applied to the top-k set renormalised: top_k=4 then top_p=0.9 of those four.
    four = torch.softmax(LOGITS[by_rank[:4]], dim=-1).cumsum(0)
    n_keep = int((four < 0.9).sum()) + 1
    ids = _draws(LOGITS, SamplingParams(top_k=4, top_p=0.9), n=20000)
    assert _chi_square(ids, restricted(by_rank[:n_keep], 1.0)) < CHI2_LIMIT
    # min_p keeps tokens with p >= min_p * p_max: exp(l - l_max) >= 0.2 -> logits >= 3 + ln 0.2 = 1.39.
    ids = _draws(LOGITS, SamplingParams(min_p=0.2), n=20000)
    assert _chi_square(ids, restricted([7, 0, 2], 1.0)) < CHI2_LIMIT


def _state(batch: SamplingBatch, prompts: list[list[int]], outputs: list[list[int]]) -> PenaltyState:
    return PenaltyState.build(batch, prompts, outputs)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5]])
    batch = _batch([SamplingParams(repetition_penalty=2.0)], 5)
    state = _state(batch, prompts=[[0]], outputs=[[1]])  # 0 seen in the prompt, 1 in the output
    expected = torch.tensor([[1.0, -2.0, 3.0, -2.0, 0.5]])
    assert torch.equal(apply_penalties(logits, batch, state), expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5]])), "input logits must not change"


def test_frequency_and_presence_penalties_use_output_counts_only() -> None:
    logits = torch.zeros(2, 4)
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(presence_penalty=1.5)]
    batch = _batch(params, 4)
    state = _state(batch, prompts=[[3, 3], [3]], outputs=[[0, 0, 2], [2, 2, 2]])
    expected = torch.tensor([[-1.0, 0.0, -0.5, 0.0], [0.0, 0.0, -1.5, 0.0]])
    assert torch.equal(apply_penalties(logits, batch, state), expected)
    state.record(torch.tensor([1, 0]))
    expected = torch.tensor([[-1.0, -0.5, -0.5, 0.0], [-1.5, 0.0, -1.5, 0.0]])
    assert torch.equal(apply_penalties(logits, batch, state), expected)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5),  # 2 / 1.5 = 1.33 < 1.5
        SamplingParams(temperature=0, frequency_penalty=0.3),  # 2 - 2 * 0.3 = 1.4 < 1.5
        SamplingParams(temperature=0, presence_penalty=0.4),  # 2 - 0.4 = 1.6 > 1.5
    ]
    batch = _batch(params, 3)
    state = _state(batch, prompts=[[0], [], []], outputs=[[], [0, 0], [0, 0]])
    assert sample(logits, batch, state).next_token_ids.tolist() == [1, 1, 0]
    with pytest.raises(ValueError, match="PenaltyState"):
        sample(logits, batch)


def check_logit_bias(device: torch.device) -> None:
    """Greedy rows: +100 makes a low token the argmax even where the caller's argmax is given, -100 takes the
    argmax out; a sampled row whose other tokens all get -100 draws its one token; an unbiased neighbour keeps
    the caller's argmax; logprobs stay those of the raw logits."""
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0]] * 4, device=device)
    params = [
        SamplingParams(temperature=0, logit_bias={"3": 100}),
        SamplingParams(temperature=0, logit_bias={0: -100.0}),
        SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100, 2: -100}),
        SamplingParams(temperature=0),
    ]
    batch = _batch(params, 4, device, default_generator=make_generator(0, device))
    assert batch.use_logit_bias and not batch.needs_penalty_state
    greedy = torch.zeros(4, dtype=torch.int64, device=device)
    out = sample(logits, batch, greedy_ids=greedy, top_logprobs_num=1)
    assert out.next_token_ids.tolist() == [3, 2, 3, 0]
    rows = torch.arange(4, device=device)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, dim=-1)[rows, out.next_token_ids])
    biased = apply_penalties(logits, batch, None)
    assert biased[0].tolist() == [2.0, 0.5, 1.5, 99.0] and torch.equal(biased[3], logits[3])
    assert not _batch([SamplingParams(temperature=0)], 4, device).use_logit_bias


def test_logit_bias_is_added_to_its_rows_logits_before_greedy_and_sampled_choices() -> None:
    check_logit_bias(CPU)


@pytest.mark.gpu
def test_logit_bias_on_cuda() -> None:
    """The same on CUDA: the bias rows are written with index_put_ on the device (no host wait)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_logit_bias(torch.device("cuda"))


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]] * 2)  # EOS (1) then stop id 2 are the likeliest
    params = [SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[2]), SamplingParams(temperature=0)]
    batch = _batch(params, 5)
    state = _state(batch, prompts=[[4], [4]], outputs=[[], []])
    chosen = []
    for _ in range(3):
        ids = sample(logits, batch, state).next_token_ids
        state.record(ids)
        chosen.append(ids.tolist())
    assert chosen == [[3, EOS], [3, EOS], [EOS, EOS]]
    assert state.output_lens.tolist() == [3, 3]


def _seeded_run(seed: int, neighbours: list[tuple[torch.Tensor, SamplingParams]], steps: int = 6) -> list[int]:
    """Tokens of a seeded request whose row (logits torch.arange(V) / 20) sits after `neighbours` in the batch."""
    vocab = 64
    mine = torch.arange(vocab, dtype=torch.float32) / 20
    params = [p for _, p in neighbours] + [SamplingParams(temperature=1.0, top_p=0.95, seed=seed)]
    gens = [make_generator(p.seed, CPU) if p.seed is not None else None for p in params]
    batch = _batch(params, vocab, generators=gens, default_generator=make_generator(123, CPU))
    logits = torch.stack([row for row, _ in neighbours] + [mine])
    return [int(sample(logits, batch).next_token_ids[-1]) for _ in range(steps)]


def test_same_seed_same_tokens_whatever_the_neighbours() -> None:
    alone = _seeded_run(42, [])
    assert _seeded_run(42, []) == alone
    noise = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    neighbours = [
        (noise[0], SamplingParams(temperature=0.7)),
        (noise[1], SamplingParams(temperature=1.3, seed=42)),  # same seed, its own generator
        (noise[2], SamplingParams(temperature=0)),
    ]
    assert _seeded_run(42, neighbours) == alone
    assert len(set(alone)) > 1, "the draws should vary from step to step"
    assert _seeded_run(43, []) != alone


def test_logprobs_are_of_raw_logits_at_the_chosen_ids() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2)) * 3
    params = [
        SamplingParams(temperature=0.3, repetition_penalty=1.7),
        SamplingParams(temperature=0, frequency_penalty=1.0),
        SamplingParams(temperature=2.0, top_k=5, presence_penalty=-1.0),
        SamplingParams(temperature=1.0, min_p=0.1),
    ]
    batch = _batch(params, 30, default_generator=make_generator(0, CPU))
    state = _state(batch, prompts=[[1, 2]] * 4, outputs=[[3, 3, 4]] * 4)
    out = sample(logits, batch, state, top_logprobs_num=6)
    reference = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(4)
    torch.testing.assert_close(out.logprobs, reference[rows, out.next_token_ids])
    ref_values, ref_ids = reference.topk(6, dim=-1)
    assert torch.equal(out.top_logprobs.ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs.values, ref_values)
    assert (out.top_logprobs.values[:, :-1] >= out.top_logprobs.values[:, 1:]).all()
    assert sample(logits, batch, state, return_logprob=False).logprobs is None


def test_prompt_logprob_helpers_match_log_softmax() -> None:
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(3)) * 4
    ids = torch.randint(0, 40, (7,), generator=torch.Generator().manual_seed(4))
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logprobs_of(logits, ids), reference[torch.arange(7), ids])
    top = top_logprobs(logits, 5)
    assert torch.equal(top.ids, reference.topk(5, dim=-1).indices)
    torch.testing.assert_close(top.values, reference.topk(5, dim=-1).values)
    assert (top.values[:, :-1] >= top.values[:, 1:]).all()


def test_build_rejects_mismatched_generators_and_logits_shape() -> None:
    with pytest.raises(ValueError, match="generators"):
        _batch([SamplingParams()] * 2, 10, generators=[None])
    with pytest.raises(ValueError, match="logits shape"):
        sample(torch.zeros(2, 9), _batch([SamplingParams()] * 2, 10))


def test_batch_sampler_records_each_step_as_a_fresh_build_would_see_it() -> None:
    """Built once and stepped, the sampler's history equals one rebuilt from the host's ids before every step:
    the same tokens under penalties, min_new_tokens and seeded draws."""
    vocab, steps = 40, 6
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4, seed=7),
        SamplingParams(temperature=0, min_new_tokens=3),
        SamplingParams(temperature=1.0, top_k=5, seed=3),
    ]
    prompts = [[2, 5, 9], [4], [1, 1], [7, 8]]
    logits = [torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(s)) * 2 for s in range(steps)]
    for step_logits in logits:
        step_logits[2, EOS] = 50.0  # row 2 wants EOS at once: min_new_tokens must hold it back for 3 steps

    def requests(outputs: list[list[int]], seeds: list[torch.Generator | None]) -> list[RequestSampling]:
        return [
            RequestSampling(p, g, prompt, out, True, 2) for p, g, prompt, out in zip(params, seeds, prompts, outputs)
        ]

    def generators() -> list[torch.Generator | None]:
        return [make_generator(p.seed, CPU) if p.seed is not None else None for p in params]

    kept_outputs: list[list[int]] = [[] for _ in params]
    kept = BatchSampler.build(requests(kept_outputs, generators()), vocab, CPU, [EOS], make_generator(0, CPU))
    fresh_outputs: list[list[int]] = [[] for _ in params]
    fresh_generators, default = generators(), make_generator(0, CPU)
    for step_logits in logits:
        for row, token in enumerate(kept.sample(step_logits).next_token_ids.tolist()):
            kept_outputs[row].append(token)
        fresh = BatchSampler.build(requests(fresh_outputs, fresh_generators), vocab, CPU, [EOS], default)
        for row, token in enumerate(fresh.sample(step_logits).next_token_ids.tolist()):
            fresh_outputs[row].append(token)
    assert kept_outputs == fresh_outputs
    assert EOS not in kept_outputs[2][:3] and kept_outputs[2][3] == EOS
    assert len(set(kept_outputs[0])) == steps  # the repetition penalty moved greedy off its repeats
