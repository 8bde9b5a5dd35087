"""Accepting drafts: greedy keeps the longest run matching the target's choices plus one target token; with
sampling, the emitted tokens are distributed as the target's own samples (a statistical check on a tiny
vocabulary with a fixed seed, so it is exact to rerun)."""

from __future__ import annotations

import pytest
import torch

from srt.managers.verify_round import simulate_acceptance
from srt.speculative.accept import accept_greedy, accept_sampled, accepted_prefix

SAMPLES = 40_000  # each frequency's standard error is below 0.0025
MAX_TOTAL_VARIATION = 0.015


def test_accepted_prefix_counts_the_leading_run() -> None:
    accepts = torch.tensor([[True, True, True], [False, True, True], [True, False, True], [True, True, False]])
    assert accepted_prefix(accepts).tolist() == [3, 0, 1, 2]


def test_greedy_accepts_per_request_and_emits_the_targets_tokens() -> None:
    """Different acceptance per request in one batch: all, none, part."""
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 9, 7]])
    target = torch.tensor([[5, 6, 7, 8], [1, 6, 7, 8], [5, 6, 7, 8]])
    accepted = accept_greedy(drafts, target)
    assert accepted.num_accepted.tolist() == [3, 0, 1]
    emitted = [row[: n + 1] for row, n in zip(accepted.tokens.tolist(), accepted.num_accepted.tolist(), strict=True)]
    assert emitted == [[5, 6, 7, 8], [1], [5, 6]]


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="2 x 3 drafts need 2 x 4 target rows"):
        accept_greedy(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="target rows"):
        accept_sampled(torch.zeros(2, 3, dtype=torch.int64), torch.full((2, 3, 5), 0.2))


def test_certain_and_impossible_drafts() -> None:
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], [[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]]])
    drafts = torch.tensor([[1], [0]])  # row 0: p(d) = 1, always accepted; row 1: p(d) = 0, always rejected
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        accepted = accept_sampled(drafts, probs, generator)
        assert accepted.num_accepted.tolist() == [1, 0]
        assert accepted.tokens[0, 0] == 1 and accepted.tokens[0, 1] in (0, 2)  # the bonus from p_1
        assert accepted.tokens[1, 0] in (1, 2)  # the residual: never the rejected draft


def test_sampling_keeps_the_targets_distribution() -> None:
    """K = 2 over a 5-token vocabulary: the first emitted token follows p_0; after an accepted first draft the
    second follows p_1; the chance of accepting the first draft is p_0(d_1)."""
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    drafts = torch.tensor([[1, 4]]).expand(SAMPLES, 2)
    accepted = accept_sampled(drafts, p.expand(SAMPLES, 3, 5), torch.Generator().manual_seed(1))
    first = accepted.tokens[:, 0]
    assert _total_variation(first, p[0]) < MAX_TOTAL_VARIATION
    after_first_draft = accepted.num_accepted >= 1
    assert abs(after_first_draft.float().mean().item() - p[0, 1].item()) < MAX_TOTAL_VARIATION
    assert torch.equal(first[after_first_draft], torch.ones(int(after_first_draft.sum()), dtype=torch.int64))
    assert _total_variation(accepted.tokens[after_first_draft, 1], p[1]) < MAX_TOTAL_VARIATION
    both = accepted.num_accepted == 2  # the bonus token after two accepted drafts follows p_2
    assert both.sum() > 1000 and _total_variation(accepted.tokens[both, 2], p[2]) < 2 * MAX_TOTAL_VARIATION


def _total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    frequencies = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (frequencies - probs.double()).abs().sum().item()


def test_simulated_acceptance_is_exact_per_request_and_differs_by_row() -> None:
    """SRT_SIMULATE_ACCEPT_LEN=2.5: every request accepts 1.5 drafts per round over any two rounds (no random
    draw: runs compare), half the rows 2 and half 1 in each round, never more than its drafts."""
    drafts, target = torch.full((4, 3), 7), torch.full((4, 4), 9)
    counts = torch.tensor([3, 3, 3, 3])
    totals = torch.zeros(4, dtype=torch.int64)
    for round_index in range(10):
        out = simulate_acceptance(drafts, target, counts, 2.5, torch.arange(4) + round_index)
        assert sorted(out.num_accepted.tolist()) == [1, 1, 2, 2]
        totals += out.num_accepted
    assert totals.tolist() == [15, 15, 15, 15]
    few = simulate_acceptance(drafts, target, torch.tensor([0, 1, 3, 3]), 3.5, torch.arange(4))
    assert few.num_accepted.tolist() == [0, 1, 2, 3]
    assert few.tokens[0].tolist() == [9, 9, 9, 9] and few.tokens[3].tolist() == [7, 7, 7, 9]
