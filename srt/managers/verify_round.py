"""Speculative verify rounds inside the scheduler's steps (FROZEN_KV_MTP, issue #23).

A decoding request that speculates takes part in a step with its newest token t0 (sampled, no KV yet)
followed by its k drafts: k + 1 rows, every one a logits row.

    rows       t0  d1  d2  d3           positions kv_len .. kv_len + k; the step writes KV for all of them
    target     c0  c1  c2  c3           c_i: the target's token after row i
    accept     d1 == c0, d2 == c1, ...  n drafts (speculative sampling with temperature: `accept_sampled`)
    emitted    d1 .. dn, c_n            n + 1 tokens; a stop inside them ends the request there
    KV kept    t0, d1 .. d(m-1)         one row per emitted token kept (m); the rest is given back
    next round newest token c_n, the hidden state of row n

A request speculates when its sampling does not depend on its own history within the round: penalties and
min_new_tokens would score row i after drafts the host has not accepted yet, so such requests decode one token
at a time in the same steps (as do requests with a logit_bias, which only the sampler applies). A constrained
request speculates: its drafts are read to the host, and each of its verify rows is masked by its grammar after
the drafts before it (`grammar.mask_verify_rows`). Apart from those drafts nothing here reads the device until
`VerifyRound.apply`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from srt.forward.host_device import DeviceToHost, host_to_device
from srt.managers.io_struct import TokenLogprob
from srt.managers.kv_rollback import take_back_kv_lens
from srt.managers.request_kv import TokenPositions
from srt.managers.request_output import finish_check
from srt.managers.schedule_batch import Req
from srt.sampling.grammar import mask_verify_rows
from srt.sampling.sampler import SamplingBatch, filtered_probs, logprobs_of, top_logprobs
from srt.speculative.accept import Accepted, accept_greedy, accept_sampled


def speculates(req: Req) -> bool:
    """Whether a request verifies drafts (module docstring)."""
    params = req.params.sampling_params
    return not params.uses_token_history and not params.logit_bias


def num_drafts_for(req: Req, num_steps: int, context_len: int) -> int:
    """Drafts worth verifying for `req`: none past max_new_tokens or the context (the last emitted token is the
    target's own)."""
    if not speculates(req):
        return 0
    left = min(req.params.sampling_params.max_new_tokens - len(req.output_ids), context_len - req.num_tokens)
    return max(0, min(num_steps, left - 1))


def tokens_kept(req: Req, emitted: list[int], eos_ids: set[int], context_len: int) -> int:
    """How many of a round's `emitted` tokens `req` keeps: all of them, or up to and including the first after
    which `finish_check` ends it (max_new_tokens or the context reached, an EOS or stop token)."""
    params = req.params.sampling_params
    room = min(params.max_new_tokens - len(req.output_ids), context_len - req.num_tokens)
    stop_ids = params.stop_token_ids or ()
    kept = min(len(emitted), max(room, 1))  # the first token is always appended, as a decode step's is
    for j, token in enumerate(emitted[:kept]):
        if (token in eos_ids and not params.ignore_eos) or token in stop_ids:
            return j + 1
    return kept


class Applied(NamedTuple):
    """What `VerifyRound.apply` read: each request's accepted drafts, and the KV positions it gave back."""

    num_accepted: list[int]
    given_back: TokenPositions


@dataclass
class VerifyRound:
    """The verify rows of one step: launched on the device by `launch`, read and applied by `apply`."""

    reqs: list[Req]
    num_drafts: list[int]
    accepted: Accepted
    copies: DeviceToHost  # num accepted, tokens, then logprobs and top-k ids and values where asked for
    has_logprobs: bool
    top_logprobs_num: int
    # each request's state for its next round, on the device, before the host has read anything: its newest
    # token and its KV length (exact unless a stop ends it, and then it has no next round)
    next_newest: torch.Tensor
    next_hidden: torch.Tensor
    next_kv_lens: torch.Tensor
    row_ids: torch.Tensor  # each request's req_to_token row, on the device (the next round's drafts read it)

    @classmethod
    def launch(
        cls,
        reqs: list[Req],
        num_drafts: list[int],
        first_rows: list[int],
        drafts: torch.Tensor,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        hidden_states: torch.Tensor,
        sampling: SamplingBatch | None,
        accept_len: float | None = None,
    ) -> VerifyRound:
        """Accept drafts on the device. `first_rows`: each request's first verify row of `logits`/`hidden_states`
        [rows, ...]; `drafts` [batch, K] (a request uses its first `num_drafts`); `sampling`: the requests'
        parameters, None when all are greedy. Sets each request's `draft_hidden` for the next round."""
        device = logits.device
        k = drafts.shape[1]
        if any(req.grammar is not None for req in reqs):
            host_drafts = drafts.tolist()  # the grammars walk them (constrained steps do not overlap anyway)
            constrained = [
                (req.grammar, req.output_ids, first, host_drafts[i][:n])
                for i, (req, first, n) in enumerate(zip(reqs, first_rows, num_drafts, strict=True))
                if req.grammar is not None
            ]
            logits, greedy_ids = mask_verify_rows(logits, constrained), None
        # each kv_len already counts all its verify rows; a round keeps the newest token and its accepted drafts
        kept_before = [req.kv_len - n for req, n in zip(reqs, num_drafts, strict=True)]
        rows_of_reqs = [req.req_pool_idx for req in reqs]
        # the simulated acceptance's phase per request: its rounds so far, offset by its row (rows differ)
        phases = [] if accept_len is None else [req.spec_verify_ct + i for i, req in enumerate(reqs)]
        first, counts, kv_lens, row_ids, phases = host_to_device(
            [first_rows, num_drafts, kept_before, rows_of_reqs, phases], device
        )
        # [batch, K + 1] logits row of each verify row; a request's rows past its drafts repeat its last one
        steps = torch.arange(k + 1, device=device)
        rows = first[:, None] + torch.minimum(steps[None, :], counts[:, None])
        target_ids = (greedy_ids if greedy_ids is not None else logits.argmax(dim=-1))[rows]
        accepted = accept_greedy(drafts, target_ids, counts)
        has_logprobs = any(req.params.return_logprob for req in reqs)
        sampled = sampling is not None and not sampling.all_greedy
        # [batch, K + 1, vocab] raw logits of the verify rows, gathered once for whoever reads them
        row_logits = logits[rows] if sampled or has_logprobs else None
        if sampled:
            accepted = _accept_sampled_rows(reqs, drafts, row_logits, sampling, counts, accepted)
        if accept_len is not None:
            accepted = simulate_acceptance(drafts, accepted.tokens, counts, accept_len, phases)
        hidden = hidden_states[first + accepted.num_accepted]  # the row that chose each round's last token
        for req, req_hidden in zip(reqs, hidden.unbind(), strict=True):
            req.draft_hidden = req_hidden
        tensors = [accepted.num_accepted, accepted.tokens]
        top_num = max((req.params.top_logprobs_num for req in reqs), default=0) if has_logprobs else 0
        if has_logprobs:
            flat = row_logits.flatten(0, 1)  # raw logits, as the sampler reports them
            tensors.append(logprobs_of(flat, accepted.tokens.reshape(-1)).view(len(reqs), k + 1))
            if top_num:
                top = top_logprobs(flat, top_num)
                tensors += [top.ids.view(len(reqs), k + 1, -1), top.values.view(len(reqs), k + 1, -1)]
        next_newest = accepted.tokens.gather(1, accepted.num_accepted[:, None])[:, 0]
        next_kv_lens = kv_lens + accepted.num_accepted
        copies = DeviceToHost(tensors)
        return cls(
            reqs, num_drafts, accepted, copies, has_logprobs, top_num, next_newest, hidden, next_kv_lens, row_ids
        )

    def apply(self, eos_ids: set[int], context_len: int, window: int) -> Applied:
        """Append each request's emitted tokens up to a stop and take back the `kv_len` of rows not kept (each
        request's `kv_len` counted all its verify rows when the step was launched); their KV is for the caller
        to free (`request_kv.free_kv`, with the step's window frees)."""
        copies = iter([t.tolist() for t in self.copies.get()])
        num_accepted, tokens = next(copies), next(copies)
        logprobs = next(copies) if self.has_logprobs else None
        top_ids, top_values = (next(copies), next(copies)) if self.top_logprobs_num else (None, None)
        given_back = []
        for i, req in enumerate(self.reqs):
            kept = tokens_kept(req, tokens[i][: num_accepted[i] + 1], eos_ids, context_len)
            req.output_ids += tokens[i][:kept]
            if req.params.return_logprob:
                k = req.params.top_logprobs_num
                for j in range(kept):
                    top = list(zip(top_ids[i][j][:k], top_values[i][j][:k])) if k else []
                    req.output_logprobs.append(TokenLogprob(tokens[i][j], float(logprobs[i][j]), top))
            req.finished_reason = finish_check(req, eos_ids, context_len)
            given_back.append(self.num_drafts[i] + 1 - kept)
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += kept - 1
        return Applied(num_accepted, take_back_kv_lens(self.reqs, given_back, window))


def _accept_sampled_rows(
    reqs: list[Req],
    drafts: torch.Tensor,
    row_logits: torch.Tensor,
    sampling: SamplingBatch,
    counts: torch.Tensor,
    greedy: Accepted,
) -> Accepted:
    """Speculative sampling for the requests that sample; greedy ones keep `greedy`. Each seeded request draws
    from its own generator, the rest from the batch's default one."""
    batch, rows, vocab = row_logits.shape
    probs = filtered_probs(row_logits.reshape(batch * rows, vocab), sampling).view(batch, rows, vocab)
    num, tokens = greedy.num_accepted.clone(), greedy.tokens.clone()
    sampled = [i for i, req in enumerate(reqs) if not req.params.sampling_params.is_greedy]
    groups = [[i] for i in sampled if reqs[i].generator is not None]
    unseeded = [i for i in sampled if reqs[i].generator is None]
    groups += [unseeded] if unseeded else []
    for group in groups:
        (index,) = host_to_device([group], drafts.device)
        generator = reqs[group[0]].generator or sampling.default_generator
        out = accept_sampled(drafts[index], probs[index], generator, counts[index])
        num[index], tokens[index] = out.num_accepted, out.tokens
    return Accepted(num, tokens)


def simulate_acceptance(
    drafts: torch.Tensor, target_tokens: torch.Tensor, counts: torch.Tensor, accept_len: float, phases: torch.Tensor
) -> Accepted:
    """Benchmarks on random weights: accept `accept_len - 1` drafts per round on average whatever they are, then
    the target's token after them. Changes outputs: dummy weights only.

    Deterministic, so that runs compare: with f the fraction of a draft, a request accepts one more than the
    whole part in the rounds where floor(phase * f) steps up (phase: its rounds so far plus its row), so its
    mean over any rounds is within 1 / rounds of the asked one (fewer where its drafts run out) and the rows of
    a batch differ (at 2.5: half accept 2 drafts, half 1, alternating)."""
    whole = int(accept_len - 1)
    fraction = accept_len - 1 - whole
    extra = torch.floor((phases + 1) * fraction) - torch.floor(phases * fraction)
    num = torch.minimum(whole + extra.to(torch.int64), counts)
    steps = torch.arange(target_tokens.shape[1], device=counts.device)
    padded = torch.cat([drafts, drafts[:, :1]], dim=1)
    tokens = torch.where(steps[None, :] < num[:, None], padded, target_tokens)
    return Accepted(num, tokens)
