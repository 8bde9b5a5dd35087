"""Per-request bookkeeping after a forward: sampling, logprobs, stop checks, and the outputs to report."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.forward.host_device import DeviceToHost
from srt.managers.io_struct import FinishReason, ReqOutput, TokenLogprob
from srt.managers.schedule_batch import Req, ScheduledReq
from srt.sampling.batch_sampler import BatchSampler, RequestSampling
from srt.sampling.sampler import logprobs_of, top_logprobs


@dataclass
class SampledTokens:
    """One token per request, drawn on the device; the host reads them with `append_samples`."""

    next_ids: torch.Tensor  # [reqs] on the device: an overlapped decode step's input ids
    copies: DeviceToHost  # next ids, then logprobs and top-k ids and values where asked for
    has_logprobs: bool
    has_top_logprobs: bool


def request_sampling(req: Req) -> RequestSampling:
    """What the sampler needs of `req`."""
    params = req.params
    return RequestSampling(
        params.sampling_params, req.generator, req.prompt_ids, req.output_ids, params.return_logprob,
        params.top_logprobs_num, req.grammar,
    )  # fmt: skip


def sample_tokens(sampler: BatchSampler, logits: torch.Tensor, greedy_ids: torch.Tensor | None) -> SampledTokens:
    """Sample one token per request from its row of `logits`, on the device, and start copying the tokens
    (with logprobs if asked) to the host. `greedy_ids`: each row's argmax, where the model's logits kernel
    found it. Nothing here waits for the device."""
    out = sampler.sample(logits, greedy_ids)
    tensors = [out.next_token_ids]
    if out.logprobs is not None:
        tensors.append(out.logprobs)
    if out.top_logprobs is not None:
        tensors += [out.top_logprobs.ids, out.top_logprobs.values]
    has_top = out.top_logprobs is not None
    return SampledTokens(out.next_token_ids, DeviceToHost(tensors), out.logprobs is not None, has_top)


def append_samples(reqs: list[Req], sampled: SampledTokens) -> None:
    """Append each request's sampled token (and its logprobs if asked), waiting for the copies.

    A request that ended while the step ran (aborted, or finished by the step before under the overlap
    schedule) gets nothing: its token is dropped.
    """
    copies = iter([t.tolist() for t in sampled.copies.get()])
    next_ids = next(copies)
    logprobs = next(copies) if sampled.has_logprobs else None
    top_ids, top_values = (next(copies), next(copies)) if sampled.has_top_logprobs else (None, None)
    for i, req in enumerate(reqs):
        if req.finished:
            continue
        req.output_ids.append(next_ids[i])
        if req.params.return_logprob:
            top = []
            if top_ids is not None and req.params.top_logprobs_num:
                k = req.params.top_logprobs_num
                top = list(zip(top_ids[i][:k], top_values[i][:k]))
            req.output_logprobs.append(TokenLogprob(next_ids[i], float(logprobs[i]), top))


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
        spec_verify_ct=req.spec_verify_ct,
        spec_accepted_tokens=req.spec_accepted_tokens,
    )
    req.emitted_tokens = len(req.output_ids)
    req.emitted_output_logprobs = len(req.output_logprobs)
    req.emitted_input_logprobs = len(req.input_logprobs)
    return output
