"""Launching a scheduled step: the forward, then each item's share of the logits, sampling queued on the device.

The scheduler decides what a step computes (`ScheduleBatch`); this runs it without reading anything back:

    items:   [ decode | decode + drafts (verify) | prompt chunk (prompt logprobs?) | ... ]
    logits:  [ 1 row  | k + 1 rows              | logprob rows, + 1 row if it samples | ... ]

Prompt-logprob rows are recorded, verify rows go to the verify round (`Speculation.launch_verify`), and the
rows that sample are sampled together by the sampler of the step's sampled requests, kept while the same
requests sample (its token history stays on the device). The scheduler reads the result with the next step
in flight (the overlap schedule) or at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from srt.forward.host_device import host_to_device
from srt.managers.request_output import SampledTokens, record_prompt_logprobs, request_sampling, sample_tokens
from srt.managers.schedule_batch import Req, ScheduleBatch, ScheduledReq, fill_drafts
from srt.managers.speculation import Speculation
from srt.managers.step_trace import StepTrace
from srt.managers.verify_round import VerifyRound
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.batch_sampler import BatchSampler


@dataclass
class LaunchedStep:
    """A batch whose forward and sampling are queued on the device; `Scheduler._finish` completes it."""

    batch: ScheduleBatch
    sampled_reqs: list[Req]
    sampled: SampledTokens | None
    verify: VerifyRound | None = None


class _LogitRows(NamedTuple):
    """Where a step's logits rows go besides prompt logprobs: its sampled items and their rows, and the first
    row of each verify item."""

    sampled_items: list[ScheduledReq]
    sample_rows: list[int]
    verify_rows: list[int]


def _route_logit_rows(items: list[ScheduledReq], logits: torch.Tensor) -> _LogitRows:
    """Walk the step's rows in item order (the diagram above): record each item's prompt logprobs on the way,
    and say where the rows that sample or verify are."""
    rows = _LogitRows([], [], [])
    row = 0
    for item in items:
        num_logprob_rows = len(item.prompt_logprob_rows)
        if item.req.wants_prompt_logprobs:
            record_prompt_logprobs(item, logits[row : row + num_logprob_rows])
            row += num_logprob_rows
        if item.sample and item.num_drafts:
            rows.verify_rows.append(row)
            row += item.num_tokens
        elif item.sample:
            rows.sampled_items.append(item)
            rows.sample_rows.append(row)
            row += 1
    return rows


class StepLauncher:
    """Runs scheduled batches on one ModelRunner (with the speculation of its assistant, if any)."""

    def __init__(self, runner: ModelRunner, spec: Speculation | None, eos_ids: set[int],
                 default_generator: torch.Generator | None, trace: StepTrace) -> None:  # fmt: skip
        self.runner = runner
        self.spec = spec
        self.trace = trace
        self.eos_ids = eos_ids
        self.default_generator = default_generator  # for requests without a seed of their own
        # the sampler of the last sampled requests, kept while the same requests decode
        self._sampler: tuple[list[Req], BatchSampler] | None = None

    def launch(self, batch: ScheduleBatch, input_ids: torch.Tensor | None = None) -> LaunchedStep:
        """Queue the forward and the sampling of `batch`; `input_ids` (device): a continued decode's tokens."""
        verify_items = [item for item in batch.items if item.num_drafts]
        drafts = self.spec.draft([item.req for item in verify_items]) if verify_items else None
        slots = self.runner.token_allocator.alloc(sum(item.num_tokens for item in batch.items))
        pools = (self.runner.req_to_token_pool, self.runner.kv_pool)
        forward_batch = batch.to_forward_batch(slots, *pools, input_ids)
        if drafts is not None:
            fill_drafts(forward_batch, batch.items, drafts)
        # each new token's slot at its request's row and its position, in one op for the whole batch
        self.runner.req_to_token_pool.write_one_each(
            forward_batch.token_req_pool_indices(), forward_batch.positions, slots
        )
        self.trace.mark("forward")
        output = self.runner.forward(forward_batch)
        logits = output.logits
        rows = _route_logit_rows(batch.items, logits)
        for item in batch.items:
            item.req.kv_len += item.num_tokens
            if item.req.kv_len >= len(item.req.prompt_ids):
                item.req.prompt_logprobs_done = True
        sampled_reqs = [item.req for item in rows.sampled_items]
        verify = self.spec.launch_verify(verify_items, rows.verify_rows, drafts, output) if verify_items else None
        # decode samples every row (no index); otherwise a pinned copy of the rows: indexing a GPU tensor with a
        # Python list copies the list from pageable memory, which waits for the device
        every_row = rows.sample_rows == list(range(len(logits)))
        sample_index = None if every_row else host_to_device([rows.sample_rows], logits.device)[0]
        if self.spec is not None and sampled_reqs:
            # the next round drafts from the hidden state that sampled each request's newest token: a copy, not a
            # view of a CUDA graph's output buffer (the next replay writes there)
            hidden_states = output.hidden_states
            hidden = hidden_states[: len(rows.sample_rows)].clone() if every_row else hidden_states[sample_index]
            for req, req_hidden in zip(sampled_reqs, hidden.unbind(), strict=True):
                req.draft_hidden = req_hidden
        sampled = None
        if sampled_reqs:
            greedy_ids = output.greedy_ids
            if not every_row:  # no [rows, vocab] copy when every row samples
                logits = logits[sample_index]
                greedy_ids = None if greedy_ids is None else greedy_ids[sample_index]
            sampled = self._sample(sampled_reqs, logits, greedy_ids)
        if verify is not None:
            self.spec.draft_ahead(verify)  # last: its graph may reuse the memory of this step's outputs
        return LaunchedStep(batch, sampled_reqs, sampled, verify)

    def _sample(self, reqs: list[Req], logits: torch.Tensor, greedy_ids: torch.Tensor | None) -> SampledTokens:
        """Sample the requests' next tokens with the sampler of this composition (built when it changes)."""
        sampler = None
        if self._sampler is not None and len(self._sampler[0]) == len(reqs):
            # by identity: the list holds its requests, so a new request cannot take an old one's place; the
            # same requests sampled in the step before, so the sampler's history is theirs to this step
            same = all(a is b for a, b in zip(self._sampler[0], reqs, strict=True))
            sampler = self._sampler[1] if same else None
        if sampler is None:
            sampler = BatchSampler.build(
                [request_sampling(req) for req in reqs],
                vocab_size=logits.shape[-1],
                device=logits.device,
                eos_token_ids=sorted(self.eos_ids),
                default_generator=self.default_generator,
            )
        self._sampler = (reqs, sampler)
        return sample_tokens(sampler, logits, greedy_ids)
