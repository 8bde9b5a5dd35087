"""Per-request bookkeeping after a forward: sampling, logprobs, stop checks, and the outputs to report."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from srt.layers.sampler import PenaltyState, SamplingBatch, logprobs_of, sample, top_logprobs
from srt.managers.io_struct import FinishReason, ReqOutput, TokenLogprob
from srt.managers.schedule_batch import Req, ScheduledReq


def sample_batch(
    reqs: list[Req],
    logits: torch.Tensor,
    eos_ids: Iterable[int],
    default_generator: torch.Generator | None,
    sampling: SamplingBatch | None = None,
) -> SamplingBatch:
    """Sample one token per request from its row of `logits` and append it (with logprobs if asked).

    Returns the SamplingBatch used; pass it back as `sampling` while the requests stay the same (decode steps)
    to skip rebuilding it.
    """
    batch = sampling or SamplingBatch.build(
        [req.params.sampling_params for req in reqs],
        vocab_size=logits.shape[-1],
        device=logits.device,
        eos_token_ids=sorted(eos_ids),
        generators=[req.generator for req in reqs],
        default_generator=default_generator,
    )
    penalties = None
    if batch.needs_penalty_state:
        penalties = PenaltyState.build(batch, [req.prompt_ids for req in reqs], [req.output_ids for req in reqs])
    want_logprobs = any(req.params.return_logprob for req in reqs)
    top_k = max(req.params.top_logprobs_num for req in reqs)
    out = sample(logits, batch, penalties, return_logprob=want_logprobs, top_logprobs_num=top_k)
    next_ids = out.next_token_ids.tolist()
    for i, req in enumerate(reqs):
        req.output_ids.append(next_ids[i])
        if req.params.return_logprob:
            top = []
            if out.top_logprobs is not None and req.params.top_logprobs_num:
                k = req.params.top_logprobs_num
                top = list(zip(out.top_logprobs.ids[i, :k].tolist(), out.top_logprobs.values[i, :k].tolist()))
            req.output_logprobs.append(TokenLogprob(next_ids[i], float(out.logprobs[i]), top))
    return batch


def record_prompt_logprobs(item: ScheduledReq, logits: torch.Tensor) -> None:
    """Score prompt tokens: the row at position q gives the logprob of prompt token q + 1."""
    req = item.req
    if req.params.logprob_start_len == 0 and not req.input_logprobs:
        req.input_logprobs.append(TokenLogprob(req.prompt_ids[0], None))  # nothing predicts the first token
    if not len(item.prompt_logprob_rows):
        return
    targets = [req.prompt_ids[q + 1] for q in item.prompt_logprob_rows]
    chosen = logprobs_of(logits, torch.tensor(targets, device=logits.device)).tolist()
    k = req.params.top_logprobs_num
    tops = top_logprobs(logits, k) if k else None
    for i, target in enumerate(targets):
        top = list(zip(tops.ids[i].tolist(), tops.values[i].tolist())) if tops is not None else []
        req.input_logprobs.append(TokenLogprob(target, chosen[i], top))


def finish_check(req: Req, eos_ids: set[int], context_len: int) -> FinishReason | None:
    """Why the request is done after its latest token, or None if it goes on."""
    params = req.params.sampling_params
    if req.kv_len < len(req.prompt_ids) and not req.output_ids:
        return None  # still in prefill
    if len(req.output_ids) >= params.max_new_tokens:
        return FinishReason("length", params.max_new_tokens)
    last = req.output_ids[-1]
    if not params.ignore_eos and last in eos_ids:
        return FinishReason("stop", last)
    if params.stop_token_ids and last in params.stop_token_ids:
        return FinishReason("stop", last)
    if len(req.prompt_ids) + len(req.output_ids) >= context_len:
        return FinishReason("length", message="reached the context length")
    return None


def collect_output(req: Req) -> ReqOutput:
    """What the request produced since its last report."""
    output = ReqOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[req.emitted_tokens :],
        finished_reason=req.finished_reason,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        output_logprobs=req.output_logprobs[req.emitted_output_logprobs :],
        input_logprobs=req.input_logprobs[req.emitted_input_logprobs :],
    )
    req.emitted_tokens = len(req.output_ids)
    req.emitted_output_logprobs = len(req.output_logprobs)
    req.emitted_input_logprobs = len(req.input_logprobs)
    return output
