"""Run a fixed batch of prompts to completion: one prefill, then greedy decode steps.

This is the simplest driver of the ModelRunner (no admission, no cache): `bench_one_batch` and the model
tests use it. Serving goes through the scheduler instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner


@dataclass
class StaticBatchResult:
    output_ids: list[list[int]]  # greedy tokens per prompt
    step_logits: list[torch.Tensor]  # per step (prefill first), [batch, vocab] float32 on the CPU; or none
    step_seconds: list[float]  # wall time of each forward, device synchronised


def generate_greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    keep_logits: bool = True,
    before_step: Callable[[int], None] | None = None,
) -> StaticBatchResult:
    """Greedy outputs of `prompts` run together as one batch; every slot is freed afterwards.

    `keep_logits=False` copies only the chosen ids to the host (timing runs: at batch 32 the logits are
    32 MB a step); `before_step(step)` runs before each forward (e.g. a profiler's step marker).
    """
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    owned: list[torch.Tensor] = []
    try:
        seq_lens = [0] * len(prompts)
        new_tokens = [list(p) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        step_logits, step_seconds = [], []
        for step in range(max_new_tokens):
            slots = runner.token_allocator.alloc(sum(len(t) for t in new_tokens))
            owned.append(slots)
            offset = 0
            logits_rows = []
            for i, tokens in enumerate(new_tokens):
                runner.req_to_token_pool.write(rows[i], seq_lens[i], slots[offset : offset + len(tokens)])
                offset += len(tokens)
                logits_rows.append(offset - 1)
            batch = ForwardBatch.build(
                mode=ForwardMode.EXTEND if step == 0 else ForwardMode.DECODE,
                new_token_ids=new_tokens,
                prefix_lens=seq_lens,
                req_pool_indices=rows,
                out_cache_loc=slots,
                logits_rows=logits_rows,
                req_to_token_pool=runner.req_to_token_pool,
                kv_pool=runner.kv_pool,
            )
            if before_step is not None:
                before_step(step)
            start = time.perf_counter()
            logits = runner.forward(batch).logits
            if keep_logits:
                step_logits.append(logits.cpu())
            next_ids = logits.argmax(dim=-1).tolist()  # the copy synchronises the device
            step_seconds.append(time.perf_counter() - start)
            seq_lens = batch.seq_lens_cpu
            for i, token in enumerate(next_ids):
                outputs[i].append(token)
            new_tokens = [[token] for token in next_ids]
        return StaticBatchResult(outputs, step_logits, step_seconds)
    finally:
        for slots in owned:
            runner.token_allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)
