"""Run a fixed batch of prompts to completion: one prefill, then greedy decode steps.

This is the simplest driver of the ModelRunner (no admission, no cache): `bench_one_batch` and the model
tests use it. Serving goes through the scheduler instead.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.forward.host_device import DeviceToHost
from srt.model_executor.model_runner import ModelRunner


@dataclass
class StaticBatchResult:
    output_ids: list[list[int]]  # greedy tokens per prompt
    step_logits: list[torch.Tensor]  # per step (prefill first), [batch, vocab] float32 on the CPU; or none
    # wall time of each step until its ids were on the host; overlapped decode steps count from the previous
    # step's read, so their sum is the decode's wall time
    step_seconds: list[float]


@dataclass
class _Launched:
    """A step on its way: its ids (and logits) are being copied to the host."""

    start: float
    copies: DeviceToHost


def generate_greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    keep_logits: bool = True,
    before_step: Callable[[int], None] | None = None,
    overlap: bool | None = None,
) -> StaticBatchResult:
    """Greedy outputs of `prompts` run together as one batch; every slot is freed afterwards.

    `keep_logits=False` copies only the chosen ids to the host (timing runs: at batch 32 the logits are
    32 MB a step); `before_step(step)` runs before each forward (e.g. a profiler's step marker).
    `overlap` (default: unless --disable-overlap-schedule): each decode step takes its input ids from the
    device and is launched before the host reads the ids of the step before it. The outputs are the same.
    """
    if overlap is None:
        overlap = not runner.server_args.disable_overlap_schedule
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    owned: list[torch.Tensor] = []
    outputs: list[list[int]] = [[] for _ in prompts]
    step_logits: list[torch.Tensor] = []
    step_seconds: list[float] = []
    last_read = 0.0

    def read(step: _Launched) -> None:
        nonlocal last_read
        copies = step.copies.get()
        now = time.perf_counter()
        step_seconds.append(now - max(step.start, last_read))  # an overlapped step counts from the last read
        last_read = now
        for i, token in enumerate(copies[0].tolist()):
            outputs[i].append(token)
        if keep_logits:
            step_logits.append(copies[1])

    try:
        seq_lens = [0] * len(prompts)
        new_tokens: list[list[int]] | torch.Tensor = [list(p) for p in prompts]
        pending: _Launched | None = None
        for step in range(max_new_tokens):
            batch = _next_batch(runner, rows, seq_lens, new_tokens, owned, decode=step > 0)
            if before_step is not None:
                before_step(step)
            start = time.perf_counter()
            output = runner.forward(batch)
            greedy_ids = output.greedy_ids if output.greedy_ids is not None else output.logits.argmax(dim=-1)
            # queued before the next forward, which may reuse a CUDA graph's output buffers
            copies = DeviceToHost([greedy_ids, output.logits] if keep_logits else [greedy_ids])
            launched = _Launched(start, copies)
            seq_lens = batch.seq_lens_cpu
            if pending is not None:
                read(pending)
            pending = launched
            if not overlap or step == 0:  # the prefill is timed on its own
                read(pending)
                pending = None
            new_tokens = greedy_ids if overlap else [[ids[-1]] for ids in outputs]
        if pending is not None:
            read(pending)
        return StaticBatchResult(outputs, step_logits, step_seconds)
    finally:
        for slots in owned:
            runner.token_allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)


def _next_batch(
    runner: ModelRunner,
    rows: list[int],
    seq_lens: list[int],
    new_tokens: list[list[int]] | torch.Tensor,
    owned: list[torch.Tensor],
    decode: bool,
) -> ForwardBatch:
    """The batch of the requests' new tokens (the prompts, or one token each), with KV slots for them."""
    counts = [1] * len(rows) if isinstance(new_tokens, torch.Tensor) else [len(t) for t in new_tokens]
    slots = runner.token_allocator.alloc(sum(counts))
    owned.append(slots)
    batch = ForwardBatch.build(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        new_token_ids=new_tokens,
        prefix_lens=seq_lens,
        req_pool_indices=rows,
        out_cache_loc=slots,
        logits_rows=list(itertools.accumulate(counts, initial=-1))[1:],
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
    )
    # each new token's slot at its request's row and its position, in one op (as the scheduler writes them)
    runner.req_to_token_pool.write_one_each(batch.token_req_pool_indices(), batch.positions, slots)
    return batch
