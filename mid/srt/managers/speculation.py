"""The scheduler's side of speculative decoding (FROZEN_KV_MTP): which decoding requests verify drafts, the draft
round before a step, the verify rows' acceptance after it, and the next round drafted ahead.

    schedule   decode_item(req)       newest token + k drafts (k = 0 for requests that do not speculate)
    launch     draft(reqs)            the round's drafts (those drafted ahead, when the state matches)
               launch_verify(...)     acceptance on the device (`verify_round.VerifyRound`)
               draft_ahead(verify)    the next round, from device state, queued after everything reading the
                                      step's outputs (a draft graph reuses their memory)
    finish     finish(...)            tokens appended, rejected rows' KV lengths taken back, rounds counted
"""

from __future__ import annotations

import torch

from srt.envs import simulated_accept_len
from srt.layers.logits_processor import LogitsOutput
from srt.managers.request_kv import TokenPositions
from srt.managers.schedule_batch import Req, ScheduledReq
from srt.managers.verify_round import VerifyRound, num_drafts_for, speculates
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampler import SamplingBatch
from srt.speculative.frozen_kv_mtp import DraftRequests


class Speculation:
    """Drafting and verification for one runner with an assistant."""

    def __init__(self, runner: ModelRunner, load_format: str, default_generator: torch.Generator | None) -> None:
        self.runner = runner
        self.num_steps = runner.drafter.num_steps
        self.default_generator = default_generator
        self.accept_len = simulated_accept_len()
        if self.accept_len is not None and load_format != "dummy":
            raise ValueError("SRT_SIMULATE_ACCEPT_LEN changes outputs: it is for benchmarks with --load-format dummy")
        # verify rounds by accepted drafts (0 .. K), for /metrics and the status log
        self.accept_counts = [0] * (self.num_steps + 1)
        self._verify_sampling: tuple[list[Req], SamplingBatch] | None = None
        # the next round's drafts, launched right after a verify step (requests, drafts, their KV lengths once
        # the step is read): used when the next step verifies the same requests
        self._drafts_ahead: tuple[list[Req], torch.Tensor, list[int] | None] | None = None

    def decode_item(self, req: Req) -> ScheduledReq:
        """A decoding request's share of a step: its newest token, and drafts to verify when it speculates."""
        drafts = 0
        if req.draft_hidden is not None:
            drafts = num_drafts_for(req, self.num_steps, self.runner.context_len)
        return ScheduledReq(req, 1 + drafts, True, decode=True, num_drafts=drafts)

    def draft(self, reqs: list[Req]) -> torch.Tensor:
        """[reqs, K] drafts from each request's newest token and the hidden state that sampled it; those the
        step before launched for the same requests in the same state, when it did."""
        ahead, self._drafts_ahead = self._drafts_ahead, None
        if ahead is not None and ahead[2] is not None and len(ahead[0]) == len(reqs):
            if all(a is b and a.kv_len == n for a, b, n in zip(ahead[0], reqs, ahead[2], strict=True)):
                return ahead[1]
        device = self.runner.device
        newest = torch.tensor([req.output_ids[-1] for req in reqs], dtype=torch.int64).to(device, non_blocking=True)
        hidden = torch.stack([req.draft_hidden for req in reqs])
        rows = [req.req_pool_idx for req in reqs]
        return self.runner.draft(DraftRequests(newest, hidden, [req.kv_len for req in reqs], rows))

    def launch_verify(
        self, items: list[ScheduledReq], first_rows: list[int], drafts: torch.Tensor, output: LogitsOutput
    ) -> VerifyRound:
        """Acceptance of the verify items' rows (`first_rows`: each one's first logits row) on the device."""
        reqs = [item.req for item in items]
        return VerifyRound.launch(
            reqs, [item.num_drafts for item in items], first_rows, drafts, output.logits, output.greedy_ids,
            output.hidden_states, self._sampling_of(reqs), self.accept_len,
        )  # fmt: skip

    def draft_ahead(self, verify: VerifyRound) -> None:
        """Queue the next round's drafts from the verify step's device state; call it after everything that
        reads the step's outputs is queued."""
        ahead = self.runner.draft_ahead(verify.next_newest, verify.next_hidden, verify.next_kv_lens, verify.row_ids)
        self._drafts_ahead = None if ahead is None else (verify.reqs, ahead, None)

    def finish(
        self, verify: VerifyRound | None, items: list[ScheduledReq], eos_ids: set[int], window: int
    ) -> TokenPositions:
        """Read a step's verify rows (tokens appended, `kv_len` of rejected rows taken back) and count its rounds;
        returns the KV positions given back, for the caller to free (`request_kv.free_kv`)."""
        given_back = TokenPositions()
        if verify is not None:
            applied = verify.apply(eos_ids, self.runner.context_len, window)
            for num in applied.num_accepted:
                self.accept_counts[num] += 1
            given_back = applied.given_back
            if self._drafts_ahead is not None and self._drafts_ahead[0] is verify.reqs:
                reqs, drafts, _ = self._drafts_ahead
                self._drafts_ahead = (reqs, drafts, [req.kv_len for req in reqs])
        # a speculating request's last tokens, with nothing left to draft, are rounds of their own
        for item in items:
            if item.decode and not item.num_drafts and speculates(item.req):
                item.req.spec_verify_ct += 1
                self.accept_counts[0] += 1
        return given_back

    def _sampling_of(self, reqs: list[Req]) -> SamplingBatch | None:
        """The verify rows' sampling parameters (each request's repeated over its K + 1 rows); None when every
        request is greedy. Kept while the same requests verify."""
        if all(req.params.sampling_params.is_greedy for req in reqs):
            return None
        cached = self._verify_sampling
        if cached is None or len(cached[0]) != len(reqs) or any(a is not b for a, b in zip(cached[0], reqs)):
            params = [req.params.sampling_params for req in reqs for _ in range(self.num_steps + 1)]
            sampling = SamplingBatch.build(
                params, self.runner.model_config.vocab_size, self.runner.device,
                default_generator=self.default_generator,
            )  # fmt: skip
            self._verify_sampling = cached = (reqs, sampling)
        return cached[1]
