"""The scheduler: turns a stream of requests into batches and keeps KV memory from running out mid-step.

One step: one token for every decoding request, then prompt chunks of admitted or partly prefilled requests
under the budgets (a mixed batch; `--disable-mixed-batches` runs prefill steps without the decoding requests),
or, with no prompt work, a decode step -> run the model -> sample -> update requests -> report -> cache. A
decoding request so waits at most one step for its next token while prompts are prefilled. When memory runs
short it evicts unlocked prefix-cache entries, then retracts decode requests back to the waiting queue.

Overlap schedule (default; --disable-overlap-schedule turns it off). Step n + 1 is launched before the host
reads step n's tokens: every request step n sampled takes that token as its input id, on the device, and the
rest of the step (prompt chunks, new admissions) is scheduled from what the host knows; the host's
bookkeeping runs while the GPU computes, after decode and prompt steps alike:

    host:  launch n+1 | read n, stop checks, report | launch n+2 | read n+1, ...
    GPU:   ... step n ][ step n+1 ......................][ step n+2 ......

A request that finished at step n has run in step n + 1 too: that token is dropped, and the KV it wrote
(of the request's last token, valid) goes to the cache with the rest when the request is released. Steps
run in stream order, so KV freed on the host while a step still runs is only reused by later steps.
What needs step n's tokens on the host first finishes the step in flight: a verify round, a grammar, a pool
too short without retraction, a request that sampled nothing, and penalties (or min_new_tokens) when the
sampled requests change (a new sampler builds its history from the host; the same requests keep theirs,
recorded on the device: `sampling/batch_sampler.py`). A prompt's KV goes to the cache one step late, the
next chunk's (queued, written before any later step reads it) with it; caching reads nothing back from the
device (the request's `swa_freed_upto` says which of its tokens hold SWA KV), or it would wait for that step.

A step runs through `step_launcher.py` (the forward, each item's logits rows, the sampling queued on the
device); the scheduler chooses the steps and does the requests' bookkeeping once their tokens are read.

Speculative decoding (FROZEN_KV_MTP). A decoding request that speculates runs as a verify item: the assistant
drafts k tokens for it before the step, and the step computes its newest token and the drafts (k + 1 rows,
mixed with prompt chunks like any decode row); the host then appends the accepted tokens and gives back the
KV of the rejected rows (`verify_round.py`). Verify steps are not overlapped: the next round needs the count.
"""

from __future__ import annotations

import logging
import time

import torch

from srt.forward.forward_batch import ForwardMode
from srt.forward.host_device import host_to_device
from srt.managers import request_kv
from srt.managers.io_struct import FinishReason, ReqOutput, TokenizedGenerateReq
from srt.managers.request_output import append_samples, collect_output, finish_check
from srt.managers.schedule_batch import Req, ScheduleBatch, ScheduledReq
from srt.managers.schedule_policy import PrefillBudget, order_waiting
from srt.managers.speculation import Speculation
from srt.managers.step_launcher import LaunchedStep, StepLauncher
from srt.managers.step_trace import StepTrace
from srt.managers.tokenizer_loader import load_grammar_vocab
from srt.mem_cache.base_prefix_cache import PrefixCache
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.model_executor.model_runner import ModelRunner
from srt.multimodal.chunking import chunk_without_split_image
from srt.sampling.grammar import GrammarMatchers
from srt.sampling.sampler import make_generator
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over one ModelRunner. Drive it with `add_request`, `abort` and `step`."""

    def __init__(self, server_args: ServerArgs, runner: ModelRunner | None = None) -> None:
        self.args = server_args
        self.runner = runner or ModelRunner(server_args)
        self.allocator = self.runner.token_allocator
        self.req_to_token_pool = self.runner.req_to_token_pool
        drafter = self.runner.drafter
        # the sliding-window KV each request keeps: the target's window, and what the drafter reads beyond it
        self.sliding_window = self.runner.model_config.sliding_window + (drafter.extra_swa_tokens if drafter else 0)
        self.cache: PrefixCache = (
            ChunkCache(self.allocator)
            if server_args.disable_radix_cache
            else SWARadixCache(self.allocator, self.sliding_window)
        )
        self._draft_tokens = 0  # drafts of the decode items of the step being scheduled
        self.eos_ids = set(self.runner.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.num_retractions = 0
        self.trace = StepTrace()  # SRT_STEP_TRACE: the timeline of steps, for bench/step_trace.py
        # requests without a seed of their own draw from this one, seeded by --seed
        self.default_generator = make_generator(server_args.seed, self.runner.device)
        # speculative decoding (None without an assistant)
        self.spec = Speculation(self.runner, server_args.load_format, self.default_generator) if drafter else None
        self.launcher = StepLauncher(self.runner, self.spec, self.eos_ids, self.default_generator, self.trace)
        self.overlap = not server_args.disable_overlap_schedule
        self._in_flight: LaunchedStep | None = None  # a step launched, its tokens not read yet
        vocab = self.runner.model_config.vocab_size
        self.grammars = GrammarMatchers(lambda: load_grammar_vocab(server_args, vocab, sorted(self.eos_ids)))

    # ---- requests in -----------------------------------------------------------------------------------
    def add_request(self, request: TokenizedGenerateReq) -> None:
        """Queue a request; raises ValueError naming the bad field of an unservable one."""
        request.check(self.runner.model_config.vocab_size, self.runner.context_len, self.allocator.full_size)
        if any(req.rid == request.rid for req in self.waiting + self.running):
            raise ValueError(f"a request with rid {request.rid!r} is already running")
        req = Req.from_request(request, self.runner.device)
        req.arrived = time.monotonic()
        self.trace.arrived(req.rid)
        if request.grammar is not None:
            req.grammar = self.grammars.matcher(request.grammar)
        self.waiting.append(req)

    def expire_waiting(self, now: float, timeout: float) -> list[str]:
        """Drop the requests that have waited more than `timeout` seconds and were never admitted (they hold
        no KV; retracted ones, which have produced tokens, stay); their rids."""
        expired = [req for req in self.waiting if not req.admitted_once and now - req.arrived > timeout]
        for req in expired:
            self.waiting.remove(req)
        return [req.rid for req in expired]

    def drop_waiting(self, rids: list[str]) -> None:
        """Drop these waiting requests (another rank's `expire_waiting` chose them)."""
        if rids:
            self.waiting = [req for req in self.waiting if req.rid not in set(rids)]

    def abort(self, rid: str) -> ReqOutput | None:
        """Stop a waiting or running request and free everything it holds; None if it is unknown."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    if req.req_pool_idx is not None:
                        self._release(req)
                    req.finished_reason = FinishReason("abort", message="aborted by the client")
                    return collect_output(req)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    def flush_cache(self) -> int | None:
        """Drop every cached prefix, its full and sliding-window KV back to the pools: the tokens dropped, or
        None (nothing done) while requests run or wait, whose prefixes the cache holds locked."""
        if self.has_work():
            return None
        return self.cache.evict(self.cache.stats().cached)

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Run one forward (prompt chunks with the decoding requests' tokens if anything can be admitted, else
        decode); report what changed.

        Under the overlap schedule a step is reported by the next call, which launches the step after it
        first when it can (module docstring).
        """
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            continued = self._continued(previous)
            if continued is not None:
                self._in_flight = self._launch(*continued)
            return self._finish(previous)
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None and self.has_work():
            # a decode step may have retracted everything to make room; admission can run again at once
            batch = self._schedule_prefill() or self._schedule_decode()
            if batch is None:
                return [self._fail_unschedulable()]
        if batch is None:
            return []
        launched = self._launch(batch)
        if self.overlap and launched.verify is None:
            self._in_flight = launched
            return []
        return self._finish(launched)

    def _fail_unschedulable(self) -> ReqOutput:
        """Nothing can run even with the cache evicted: end the request that blocks the rest, with a reason."""
        self.cache.evict(self.allocator.full_size)
        stuck = next((req for req in self.running if req.to_compute > 1), None) or self.waiting[0]
        (self.running if stuck in self.running else self.waiting).remove(stuck)
        if stuck.req_pool_idx is not None:
            self._release(stuck)
        message = (
            f"the request does not fit in KV memory (full pool {self.allocator.full_size} tokens, "
            f"sliding-window pool {self.allocator.swa_size} tokens); raise --max-total-tokens or lower "
            "--chunked-prefill-size"
        )
        stuck.finished_reason = FinishReason("abort", message=message)
        logger.warning("request %s: %s", stuck.rid, message)
        return collect_output(stuck)

    def _schedule_prefill(self, unread: list[ScheduledReq] | None = None) -> ScheduleBatch | None:
        """Prompt chunks under the budgets and, mixed in first, one token of every decoding request.

        `unread`: the decode items of a continued step (`_continued`), whose requests' newest tokens the host
        has not read yet; every other running request then has prompt tokens left."""
        self.trace.mark("schedule")
        if unread is None:
            chunked = [req for req in self.running if req.to_compute > 1]  # at most one: a prefill in progress
            decoding = [] if self.args.disable_mixed_batches else [r for r in self.running if r.to_compute == 1]
        else:
            unread_ids = {id(item.req) for item in unread}
            chunked = [req for req in self.running if id(req) not in unread_ids]
            decoding = [item.req for item in unread]
        if not chunked and not self.waiting:
            return None  # no prompt work: a decode step
        decode_items = unread if unread is not None else [self._decode_item(req) for req in decoding]
        self._draft_tokens = sum(item.num_drafts for item in decode_items)
        chunk = self.args.chunked_prefill_size or self.runner.context_len
        budget = PrefillBudget(
            # one chunk's worth of prompt tokens per step: two 8k prompts in one step would hold back the first
            # one's first token, and every decoding request's next one, by the second's whole prefill
            tokens=min(self.args.max_prefill_tokens - len(decoding) - self._draft_tokens, chunk),
            chunk=chunk,
            requests=self.args.max_running_requests - len(self.running),
        )
        items: list[ScheduledReq] = []
        for req in chunked:
            num = self._whole_images(req, budget.fit(req.to_compute))
            if num == 0 or not self._make_room(num + len(self.running) + self._draft_tokens):
                return None
            items.append(self._scheduled(req, num))
            budget.tokens -= num
        for req in order_waiting(self.waiting, self.args.schedule_policy, self.cache):
            if self.req_to_token_pool.available() == 0 or not self._admit(req, budget, items, chunked):
                break
        if not items:
            return None
        # admission reserved a token for every running request, the decoding ones among them, and their drafts
        return ScheduleBatch(ForwardMode.EXTEND, decode_items + items)

    def _admit(self, req: Req, budget: PrefillBudget, items: list[ScheduledReq], chunked: list[Req]) -> bool:
        """Try to add a waiting request to the prefill batch; False when it (and so the rest) must wait."""
        limit = req.num_tokens - 1  # at least one token must run: its logits are needed
        if req.wants_prompt_logprobs:
            limit = min(limit, req.prompt_logprob_first_row())
        match = self.cache.match_prefix(req.cache_tokens(limit))
        pending = req.num_tokens - match.prefix_len
        num = self._whole_images(req, budget.fit(pending), match.prefix_len) if budget.requests > 0 else 0
        if num == 0 or (num < pending and (chunked or any(item.num_tokens < item.req.to_compute for item in items))):
            return False  # one chunked request at a time
        self.cache.lock(match.node)  # before evicting, so room is not made out of this very prefix
        # room for this chunk, the chunks already in the batch, and one decode token per running request
        reserved = sum(item.num_tokens for item in items)
        if not self._make_room(reserved + num + len(self.running) + self._draft_tokens + 1):
            self.cache.unlock(match.node)
            return False
        req.req_pool_idx = self.req_to_token_pool.alloc()
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
        req.prefix, req.kv_len, req.swa_freed_upto = match, match.prefix_len, match.prefix_len
        if not req.admitted_once:
            req.cached_tokens, req.admitted_once = match.prefix_len, True
        self.waiting.remove(req)
        self.running.append(req)
        items.append(self._scheduled(req, num))
        budget.take(num)
        return True

    def _whole_images(self, req: Req, num: int, start: int | None = None) -> int:
        """`num` tokens from `start` (req.kv_len), or fewer so that no image is split across chunks, where image
        tokens attend to each other both ways (multimodal/chunking.py)."""
        if not num or req.params.mm_inputs is None or not self.runner.model_config.bidirectional_images:
            return num
        return chunk_without_split_image(req.params.mm_inputs, req.kv_len if start is None else start, num)

    def _scheduled(self, req: Req, num: int) -> ScheduledReq:
        completes = num == req.to_compute
        rows = range(0)
        if req.wants_prompt_logprobs:
            first = max(req.prompt_logprob_first_row(), req.kv_len)
            rows = range(first, max(first, min(len(req.prompt_ids) - 1, req.kv_len + num)))
        sample = completes and len(req.output_ids) < req.params.sampling_params.max_new_tokens
        return ScheduledReq(req, num, sample, rows, completes=completes)

    def _decode_item(self, req: Req) -> ScheduledReq:
        """A decoding request's share of a step: its newest token, and drafts to verify when it speculates."""
        if self.spec is not None:
            return self.spec.decode_item(req)
        return ScheduledReq(req, 1, True, decode=True)

    def _continued(self, previous: LaunchedStep) -> tuple[ScheduleBatch, torch.Tensor | None] | None:
        """The step after `previous`, launched before its tokens are read, and the input ids of its leading
        decode items (those tokens, on the device): one token for every request `previous` sampled, then prompt
        chunks under the budgets as `_schedule_prefill` takes them. None when the host must read first."""
        if previous.verify is not None:
            return None  # the next round needs the accepted counts
        sampled = previous.sampled_reqs
        live = [i for i, req in enumerate(sampled) if req.req_pool_idx is not None and not req.finished]
        decoding = [sampled[i] for i in live]
        decoding_ids = {id(req) for req in decoding}
        prompts = [req for req in self.running if id(req) not in decoding_ids]
        if len(decoding) + len(prompts) != len(self.running) or any(req.to_compute < 1 for req in prompts):
            return None  # a request that sampled nothing (max_new_tokens 0) finishes first
        if any(req.grammar is not None for req in self.running):
            return None  # a grammar's next mask needs the step's tokens on the host
        changes = len(live) < len(sampled) or prompts or self.waiting
        if changes and any(req.params.sampling_params.uses_token_history for req in decoding):
            return None  # a new sampler would build its token history from the host, a token behind
        items = [self._decode_item(req) for req in decoding]
        if any(item.num_drafts for item in items):
            return None  # drafting reads the newest tokens on the host
        ids = None
        if previous.sampled is not None and decoding:
            ids = previous.sampled.next_ids
            if len(live) < len(sampled):  # drop the rows of requests finished since
                ids = ids[host_to_device([live], ids.device)[0]]
        if prompts or self.waiting:
            if self.args.disable_mixed_batches:
                return None  # a prompt step without the decoding requests, scheduled once they are read
            batch = self._schedule_prefill(items)
            if batch is not None:
                return batch, ids
            if prompts:
                return None  # the prompt's next chunk did not fit: room is made with every token read
        if not decoding:
            return None
        if not self._make_room(len(decoding)):
            return None  # retraction decides with every token read
        return ScheduleBatch(ForwardMode.DECODE, items), ids

    def _schedule_decode(self) -> ScheduleBatch | None:
        items = [self._decode_item(req) for req in self.running if req.to_compute == 1]
        # fewest output tokens first (they lose the least work), latest admitted first among equals
        while items and not self._make_room(sum(item.num_tokens for item in items)):
            victim = min(reversed(items), key=lambda item: len(item.req.output_ids))
            items.remove(victim)
            self._retract(victim.req)
        if not items:
            return None
        # several rows per request (a verify step) take the extend layout
        mode = ForwardMode.EXTEND if any(item.num_drafts for item in items) else ForwardMode.DECODE
        return ScheduleBatch(mode, items)

    # ---- run and update ----------------------------------------------------------------------------------
    def _launch(self, batch: ScheduleBatch, input_ids: torch.Tensor | None = None) -> LaunchedStep:
        self.trace.launched(batch, len(self.waiting), len(self.running))
        return self.launcher.launch(batch, input_ids)

    def _finish(self, launched: LaunchedStep) -> list[ReqOutput]:
        """Read a launched batch's tokens; stop checks, releases and caching; what each request produced."""
        if launched.sampled is not None:
            append_samples(launched.sampled_reqs, launched.sampled)
        given_back = request_kv.TokenPositions()  # the KV of rejected drafts, freed below with the windows
        if self.spec is not None:
            given_back = self.spec.finish(launched.verify, launched.batch.items, self.eos_ids, self.sliding_window)
        self.trace.finished(launched.batch)
        outputs, out_of_window = [], []
        for item in launched.batch.items:
            req = item.req
            if req.req_pool_idx is None:
                continue  # released while the step ran: aborted, or finished by the step before
            # a verify item's tokens were checked as appended; an earlier chunk's kv_len may count the next one's
            if not req.finished and not item.num_drafts and item.completes:
                req.finished_reason = finish_check(req, self.eos_ids, self.runner.context_len)
            if req.finished:
                self.running.remove(req)
                self._release(req)
            elif not item.decode:
                # prompt KV (a chunk, or the whole prompt once done) goes to the cache, which then owns its
                # sliding-window KV: requests sharing the prefix hit it until the cache evicts it
                request_kv.cache_prefill(req, self.req_to_token_pool, self.cache)
            else:
                out_of_window.append(req)
            outputs.append(collect_output(req))
        windows = request_kv.out_of_window(out_of_window, self.sliding_window)
        request_kv.free_kv(given_back, windows, self.req_to_token_pool, self.allocator)
        self.trace.mark("finished")
        return outputs

    def _release(self, req: Req) -> None:
        request_kv.release(req, self.req_to_token_pool, self.cache)

    def _retract(self, req: Req) -> None:
        """Send a decode request back to the queue; it re-runs prompt + output so far when re-admitted."""
        self.running.remove(req)
        self._release(req)
        self.waiting.insert(0, req)
        self.num_retractions += 1
        logger.info("KV memory short: retracted request %s (%d output tokens)", req.rid, len(req.output_ids))

    def _make_room(self, num_tokens: int) -> bool:
        return request_kv.make_room(num_tokens, self.allocator, self.cache)

    # ---- checks --------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every pool and cache is consistent: free + cached + the running requests' own slots == the pool."""
        table = self.req_to_token_pool.req_to_token
        own = [table[req.req_pool_idx, req.prefix.prefix_len : req.kv_len].long() for req in self.running]
        # the cache checks its allocator too, and the exact partition leaves no slot in use when idle
        self.cache.check_integrity(torch.cat(own) if own else torch.empty(0, dtype=torch.int64))
        self.req_to_token_pool.check_integrity()
        if self.req_to_token_pool.in_use() != len(self.running):
            raise AssertionError(
                f"{self.req_to_token_pool.in_use()} request rows in use, {len(self.running)} requests running"
            )
