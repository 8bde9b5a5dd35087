"""The one owner of a batch's sampling state: built once per batch composition, updated after every step.

A decode step samples the same requests as the step before it. Their parameters (`SamplingBatch`) do not
change, and their token history (`PenaltyState`, for penalties and min_new_tokens) grows by exactly the token
each step samples. So `BatchSampler` builds both once, when the composition changes, and records each step's
tokens on the device as it samples them: no [batch, vocab] history is rebuilt from host lists, and a step's
penalties never wait for the host to read the step before it (the overlap schedule keeps running).

    composition changes ──► BatchSampler.build(requests)      parameters + history from the host, once
    every step          ──► sampler.sample(logits)            sample, then record the tokens on the device
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.sampling.grammar import BatchGrammar, RequestGrammar
from srt.sampling.sampler import PenaltyState, SampleOutput, SamplingBatch, sample
from srt.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSampling:
    """What sampling needs of one request."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own (seeded) generator, kept for its whole life
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated so far: the request's own list, which grows step by step
    return_logprob: bool
    top_logprobs_num: int
    grammar: RequestGrammar | None = None  # structured output: the tokens it may sample are masked


@dataclass(eq=False)
class BatchSampler:
    """Sampling of a fixed list of requests, step after step. Rows follow the requests' order."""

    batch: SamplingBatch
    penalties: PenaltyState | None  # None when no request uses penalties or min_new_tokens
    return_logprob: bool  # some request asked for logprobs
    top_logprobs_num: int  # the largest request's count
    grammar: BatchGrammar | None = None  # None when no request is constrained

    @classmethod
    def build(
        cls,
        requests: Sequence[RequestSampling],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        default_generator: torch.Generator | None = None,
    ) -> BatchSampler:
        """The requests' parameters and token history so far, on `device`."""
        batch = SamplingBatch.build(
            [r.params for r in requests],
            vocab_size=vocab_size,
            device=device,
            eos_token_ids=eos_token_ids,
            generators=[r.generator for r in requests],
            default_generator=default_generator,
        )
        penalties = None
        if batch.needs_penalty_state:
            penalties = PenaltyState.build(batch, [r.prompt_ids for r in requests], [r.output_ids for r in requests])
        return cls(
            batch=batch,
            penalties=penalties,
            return_logprob=any(r.return_logprob for r in requests),
            top_logprobs_num=max((r.top_logprobs_num for r in requests), default=0),
            grammar=BatchGrammar.build(
                [r.grammar for r in requests], [r.output_ids for r in requests], vocab_size, batch.device
            ),
        )

    def sample(self, logits: torch.Tensor, greedy_ids: torch.Tensor | None = None) -> SampleOutput:
        """One token per row of `logits` [batch, vocab] (see `sampler.sample`), recorded in the history. Call
        it once per step, with every request of the batch sampling; nothing here waits for the device, except
        that constrained requests' grammars need their tokens of the step before on the host."""
        if self.grammar is not None:
            logits, greedy_ids = self.grammar.constrain(logits, greedy_ids)
        out = sample(logits, self.batch, self.penalties, self.top_logprobs_num, self.return_logprob, greedy_ids)
        if self.penalties is not None:
            self.penalties.record(out.next_token_ids)
        return out
