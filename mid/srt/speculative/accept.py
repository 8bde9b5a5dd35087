"""Which draft tokens a verify step accepts, and the tokens a round emits (issue #23, part 3's arithmetic).

A verify step runs the target on each request's last accepted token followed by its K drafts (K + 1 rows) and
yields the target's choice at every row. A round emits the accepted drafts plus one token of the target's own
at the first row whose draft was not accepted (or after the last draft: the bonus token):

    drafts         d1 d2 d3                     (K = 3)
    target rows    t0 t1 t2 t3                  row i scores the token after draft i (row 0: after the last
                                                accepted token)
    greedy         accept d1 .. dn while d_i == t_{i-1}; emit d1 .. dn, t_n       (n + 1 tokens, n in 0..K)

With temperature, drafts are still greedy (the assistant's argmax: a one-hot draft distribution), and speculative
sampling keeps the target's distribution exactly: draft d at row i is accepted with probability p_i(d); at the
first rejection the emitted token is drawn from p_i with d's mass removed, renormalised (the residual
max(0, p - q) of a one-hot q); after K acceptances the bonus token is drawn from p_K.

Everything stays on the device: nothing here reads a count back to the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Accepted(NamedTuple):
    num_accepted: torch.Tensor  # [batch] int64: drafts accepted, 0..K
    tokens: torch.Tensor  # [batch, K + 1] the round's tokens; the first num_accepted + 1 of each row are emitted


def accepted_prefix(accepts: torch.Tensor) -> torch.Tensor:
    """[batch] length of the leading run of True in each row of `accepts` [batch, K]."""
    return torch.cumprod(accepts.to(torch.int64), dim=1).sum(dim=1)


def drafts_in_use(draft_ids: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """[batch, K] True where a draft was verified: a request may verify fewer than K (`num_drafts` [batch])."""
    if num_drafts is None:
        return torch.ones_like(draft_ids, dtype=torch.bool)
    steps = torch.arange(draft_ids.shape[1], device=draft_ids.device)
    return steps[None, :] < num_drafts[:, None]


def accept_greedy(
    draft_ids: torch.Tensor, target_ids: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> Accepted:
    """`draft_ids` [batch, K], `target_ids` [batch, K + 1] the target's argmax at each verify row; a request
    with `num_drafts[i]` < K verified only its first drafts (its other rows are ignored)."""
    _check_shapes(draft_ids, target_ids.shape)
    num = accepted_prefix((draft_ids == target_ids[:, :-1]) & drafts_in_use(draft_ids, num_drafts))
    # accepted drafts equal the target's choices, so the emitted tokens are the target's first n + 1
    return Accepted(num, target_ids)


def accept_sampled(
    draft_ids: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    num_drafts: torch.Tensor | None = None,
) -> Accepted:
    """`draft_ids` [batch, K] greedy drafts, `target_probs` [batch, K + 1, vocab] the target's sampling
    distribution at each verify row (after temperature, top-k/p, penalties). Emits tokens distributed exactly
    as sampling the target token by token would. `num_drafts` as for `accept_greedy`."""
    batch, k = _check_shapes(draft_ids, target_probs.shape[:2])
    rows = torch.arange(batch, device=draft_ids.device)[:, None]
    steps = torch.arange(k, device=draft_ids.device)[None, :]
    draft_probs = target_probs[rows, steps, draft_ids]  # [batch, K]: p_i(d_i)
    uniform = torch.rand(draft_probs.shape, generator=generator, device=draft_probs.device)
    num = accepted_prefix((uniform < draft_probs) & drafts_in_use(draft_ids, num_drafts))
    # the distribution of the token after the accepted run: residual at a rejection, p_K after K acceptances
    last = target_probs[rows[:, 0], num].clone()  # [batch, vocab]
    rejected = num < (k if num_drafts is None else num_drafts)
    rejected_draft = draft_ids.gather(1, num.clamp(max=k - 1)[:, None])[:, 0]
    last[rows[:, 0], rejected_draft] = torch.where(rejected, 0.0, last[rows[:, 0], rejected_draft])
    # a rejection leaves mass outside d (p(d) < u <= 1), so the residual never sums to zero
    next_ids = torch.multinomial(last / last.sum(dim=-1, keepdim=True), 1, generator=generator)[:, 0]
    tokens = torch.cat([draft_ids, draft_ids[:, :1]], dim=1)
    tokens.scatter_(1, num[:, None], next_ids[:, None])
    return Accepted(num, tokens)


def _check_shapes(draft_ids: torch.Tensor, target_rows: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    batch, k = draft_ids.shape
    if tuple(target_rows) != (batch, k + 1):
        raise ValueError(f"{batch} x {k} drafts need {batch} x {k + 1} target rows; got {tuple(target_rows)}")
    return batch, k
