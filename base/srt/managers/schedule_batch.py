"""A request's state in the scheduler, and the batch it is run in.

A request only ever "catches up": its KV covers `kv_len` of its tokens (prompt + output so far) and each
forward computes some of the rest. A fresh prompt, a prefix-cache hit, a prefill chunk, a decode step and
the re-run of a retracted request are the same arithmetic:

    all_ids:  [ prompt ............................ | output ......... ]
    KV:       [ cached prefix | computed ..... kv_len)  to compute ...  )
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.forward.host_device import host_to_device
from srt.managers.io_struct import FinishReason, TokenizedGenerateReq, TokenLogprob
from srt.mem_cache.base_prefix_cache import MatchResult
from srt.multimodal.inputs import multimodal_batch
from srt.sampling.grammar import RequestGrammar
from srt.sampling.sampler import make_generator


@dataclass(eq=False)
class Req:
    """One generation request and everything the scheduler tracks about it."""

    rid: str
    prompt_ids: list[int]
    params: TokenizedGenerateReq
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None  # row of req_to_token while the request holds KV
    prefix: MatchResult | None = None  # the cached prefix it holds locked
    kv_len: int = 0  # leading tokens of all_ids whose KV is in the pools
    swa_freed_upto: int = 0  # SWA slots of tokens before this position are freed
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    admitted_once: bool = False
    arrived: float = 0.0  # time.monotonic() when the scheduler queued it (--request-timeout counts from here)
    prompt_logprobs_done: bool = False
    finished_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # structured output: where the request is in its grammar
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    emitted_tokens: int = 0  # output tokens already reported
    emitted_output_logprobs: int = 0
    emitted_input_logprobs: int = 0
    # speculative decoding: the target's hidden state that sampled the newest token (the next round drafts from
    # it, on the device), and the request's verify rounds and accepted drafts so far
    draft_hidden: torch.Tensor | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def from_request(cls, request: TokenizedGenerateReq, device: torch.device) -> Req:
        seed = request.sampling_params.seed
        # one generator for the request's whole life: recreating it would restart its random sequence
        generator = make_generator(seed, device) if seed is not None else None
        return cls(rid=request.rid, prompt_ids=list(request.input_ids), params=request, generator=generator)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids: a decode step reads one token of a long prompt."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split : stop - split]
        return self.prompt_ids[start:stop] + self.output_ids[: max(0, stop - split)]

    def cache_tokens(self, stop: int) -> list[int]:
        """The prefix-cache key of all_ids[:stop]: image placeholders stand for their image's content hash."""
        ids = self.tokens(0, stop)
        mm = self.params.mm_inputs
        return ids if mm is None else mm.cache_key(ids)

    @property
    def to_compute(self) -> int:
        """Tokens whose KV is not in the pools yet (work = tokens - cached tokens)."""
        return self.num_tokens - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (
            self.params.return_logprob and self.params.logprob_start_len is not None and not self.prompt_logprobs_done
        )

    def prompt_logprob_first_row(self) -> int:
        """Position of the first row whose logits give a prompt logprob (token p is scored by row p - 1)."""
        return max(self.params.logprob_start_len or 0, 1) - 1


@dataclass
class ScheduledReq:
    """A request's share of a batch: which of its tokens run and which rows' logits it needs."""

    req: Req
    num_tokens: int  # tokens computed this forward, starting at req.kv_len
    sample: bool  # this forward completes its tokens: sample the next one from its last row
    prompt_logprob_rows: range = range(0)  # positions whose logits score the next prompt token
    decode: bool = False  # a decoding request's one token (its window is freed, nothing goes to the cache)
    num_drafts: int = 0  # a verify item: the newest token, then this many drafts; every row is a logits row
    completes: bool = True  # False for a prompt chunk before the last: the request cannot finish after it


@dataclass
class ScheduleBatch:
    """The requests of one forward and how each takes part."""

    mode: ForwardMode
    items: list[ScheduledReq]

    def to_forward_batch(
        self, out_cache_loc: torch.Tensor, req_to_token_pool, kv_pool, input_ids: torch.Tensor | None = None
    ) -> ForwardBatch:
        """Lay out the ForwardBatch; `logits_rows` lists, per request in order, prompt-logprob rows then its
        sampling row (a verify item: all its rows). `input_ids`: the newest tokens of the first items (decode
        items, one row each) on the device, when the host has not read them yet (the overlap schedule). Drafts
        are 0 here: `fill_drafts` puts them in."""
        unread = 0 if input_ids is None else len(input_ids)
        new_tokens, prefix_lens, rows, logits_rows = [], [], [], []
        start = 0
        for index, item in enumerate(self.items):
            req = item.req
            known = item.num_tokens - item.num_drafts
            ids = [0] if index < unread else req.tokens(req.kv_len, req.kv_len + known)
            new_tokens.append(ids + [0] * item.num_drafts)
            prefix_lens.append(req.kv_len)
            rows.append(req.req_pool_idx)
            logits_rows.extend(start + pos - req.kv_len for pos in item.prompt_logprob_rows)
            if item.sample:
                logits_rows.extend(range(start + known - 1, start + item.num_tokens))
            start += item.num_tokens
        every_row_unread = unread == len(self.items) and all(item.num_tokens == 1 for item in self.items)
        batch = ForwardBatch.build(
            mode=self.mode,
            new_token_ids=input_ids if every_row_unread else new_tokens,
            prefix_lens=prefix_lens,
            req_pool_indices=rows,
            out_cache_loc=out_cache_loc,
            logits_rows=logits_rows,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
        )
        if unread and not every_row_unread:
            batch.input_ids[:unread] = input_ids  # the decode items lead, one row each
        # a verify step (decode rows, some with drafts): a few rows per request, each attending alone
        batch.attend_row_by_row = all(item.decode for item in self.items) and any(i.num_drafts for i in self.items)
        items = self.items
        if any(item.req.params.mm_inputs is not None for item in items):
            spans = [(item.req.params.mm_inputs, item.req.kv_len, item.req.kv_len + item.num_tokens) for item in items]
            batch.mm = multimodal_batch(spans)
        return batch


def fill_drafts(forward_batch: ForwardBatch, items: list[ScheduledReq], drafts: torch.Tensor) -> None:
    """Write the verify items' drafts (`drafts` [verify items, K] on the device, in item order) into the batch's
    input ids after each item's newest token."""
    k = drafts.shape[1]
    if all(item.num_drafts == k and item.num_tokens == k + 1 for item in items):
        # every item a whole verify item (a steady round): rows [newest, d1 .. dk] each, no index to copy
        forward_batch.input_ids.view(len(items), k + 1)[:, 1:] = drafts
        return
    token_index, draft_index = [], []
    start, verify = 0, 0
    for item in items:
        if item.num_drafts:
            first = start + item.num_tokens - item.num_drafts
            token_index.extend(range(first, first + item.num_drafts))
            draft_index.extend(range(verify * drafts.shape[1], verify * drafts.shape[1] + item.num_drafts))
            verify += 1
        start += item.num_tokens
    tokens, chosen = host_to_device([token_index, draft_index], forward_batch.input_ids.device)
    forward_batch.input_ids[tokens] = drafts.reshape(-1)[chosen]
