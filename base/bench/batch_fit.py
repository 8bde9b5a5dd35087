"""Whether the static batches of `bench_one_batch.py` fit the KV pools its ModelRunner will build.

A static batch (srt.model_executor.static_batch) allocates a full-pool slot and a sliding-window slot for
every prompt and generated token, and frees none of them until the batch is done:

    batch of B requests, each L = prompt + generated tokens with KV
    full pool  [ B * L slots ........ | free ]     both pools must hold B * L tokens at the end,
    swa pool   [ B * L slots ... | free ]          and the SWA pool is the smaller one by default

So B * L must fit in min(full, swa) tokens, B in --max-running-requests rows and L in the context length.
The pools are planned here with the function ModelRunner plans them with (`model_runner.plan_pools`:
--max-total-tokens, else --mem-fraction-static of the GPU's memory; 16,384 full tokens on CPU), before any
weight or pool is allocated; only the weights are counted differently (transformers' module tree
on the meta device, not the loaded state dict), so `check_runner` repeats the check on the built runner.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from srt.configs.model_config import ModelConfig, resolve_dtype
from srt.mem_cache.memory_plan import MemoryPlan, count_weight_bytes
from srt.model_executor.model_runner import CPU_DEFAULT_TOTAL_TOKENS, ModelRunner, plan_pools, resolve_device
from srt.server_args import ServerArgs


class BatchNeed(NamedTuple):
    """The KV a static batch holds at its end."""

    batch_size: int
    prompt_tokens: int  # summed over the batch
    longest_prompt: int
    new_tokens: int  # per request: generated tokens that get KV (the last sampled token gets none)

    @property
    def request_tokens(self) -> int:
        return self.longest_prompt + self.new_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.batch_size * self.new_tokens

    def describe(self) -> str:
        return (
            f"batch {self.batch_size} x ({self.longest_prompt} prompt + {self.new_tokens} generated) tokens"
            f" = {self.total_tokens:,} KV tokens"
        )


def uniform_batch(batch_size: int, input_len: int, max_new_tokens: int) -> BatchNeed:
    """`generate_greedy` of `batch_size` prompts of `input_len` tokens for `max_new_tokens` steps."""
    return BatchNeed(batch_size, batch_size * input_len, input_len, max_new_tokens - 1)


def prompt_batch(prompts: list[list[int]], max_new_tokens: int) -> BatchNeed:
    """`generate_greedy` of these prompts for `max_new_tokens` steps."""
    return BatchNeed(len(prompts), sum(map(len, prompts)), max(map(len, prompts)), max_new_tokens - 1)


class PoolCapacity(NamedTuple):
    """What bounds a static batch in the pools a runner has (or will have)."""

    full_tokens: int
    swa_tokens: int
    max_requests: int
    context_len: int


def planned_pools(
    server_args: ServerArgs, model_config: ModelConfig, gpu_memory_bytes: int | None = None
) -> tuple[MemoryPlan, str]:
    """The memory plan ModelRunner will make, and a line saying what it was sized from. `gpu_memory_bytes`:
    plan for a GPU of that size (default: the device's memory on CUDA, the CPU default elsewhere).

    ValueError (plan_memory's) when the weights or --max-total-tokens do not fit the device."""
    device = resolve_device(server_args.device)
    if gpu_memory_bytes is None and device.type == "cuda":
        gpu_memory_bytes = torch.cuda.get_device_properties(device).total_memory
    dtype = resolve_dtype(server_args.dtype, torch.device("cuda") if gpu_memory_bytes else device)
    plan = plan_pools(server_args, model_config, dtype, count_weight_bytes(model_config, dtype), gpu_memory_bytes)
    if gpu_memory_bytes:
        source = f"{gpu_memory_bytes / 2**30:.1f} GiB of GPU memory"
    elif server_args.max_total_tokens is None:
        source = f"the CPU default of {CPU_DEFAULT_TOTAL_TOKENS:,} full-pool tokens"
    else:
        source = "--max-total-tokens"
    if plan.sized_by == "mem_fraction_static":
        source = f"--mem-fraction-static {server_args.mem_fraction_static} of {source}"
    return plan, source


def misfits(need: BatchNeed, capacity: PoolCapacity) -> dict[str, str]:
    """What the batch does not fit, by kind ("pools", "rows", "context"); empty when it fits."""
    problems = {}
    if need.total_tokens > min(capacity.full_tokens, capacity.swa_tokens):
        problems["pools"] = (
            f"{need.describe()} do not fit the KV pools: full {capacity.full_tokens:,} and swa"
            f" {capacity.swa_tokens:,} tokens (a static batch keeps every token in both pools until it ends)"
        )
    if need.batch_size > capacity.max_requests:
        problems["rows"] = f"batch {need.batch_size} > --max-running-requests {capacity.max_requests}"
    if need.request_tokens > capacity.context_len:
        problems["context"] = f"{need.request_tokens} tokens per request > the context length {capacity.context_len}"
    return problems


def remedies(need: BatchNeed, plan: MemoryPlan, server_args: ServerArgs) -> str:
    """The flags that would make the pools hold `need`: with swa_full_tokens_ratio 1, the cheapest layout for a
    static batch (both pools need the same tokens), the pool size or the memory fraction it takes."""
    tokens = need.total_tokens
    if plan.sized_by == "max_total_tokens":
        return f"--max-total-tokens {tokens} --swa-full-tokens-ratio 1, or a smaller --batch-size / --input-len"
    kv_bytes = tokens * (plan.full_bytes_per_token + plan.swa_bytes_per_token)
    # kv_budget = memory * fraction - weights, so the fraction that leaves kv_bytes is:
    used = server_args.mem_fraction_static * (plan.weight_bytes + kv_bytes)
    fraction = used / (plan.weight_bytes + plan.kv_budget_bytes)
    if fraction > 0.98:
        return f"a smaller --batch-size / --input-len ({kv_bytes / 2**30:.1f} GiB of KV do not fit beside the weights)"
    return (
        f"--swa-full-tokens-ratio 1 --mem-fraction-static {math.ceil(fraction * 100) / 100:.2f},"
        " or a smaller --batch-size / --input-len"
    )


def refuse_unfit(server_args: ServerArgs, needs: list[BatchNeed], gpu_memory_bytes: int | None = None) -> None:
    """SystemExit naming the numbers and the flags to change when a batch cannot run; builds nothing.
    `gpu_memory_bytes` as in `planned_pools`."""
    model_config = ModelConfig.from_name_or_path(server_args.model_path)
    try:
        plan, source = planned_pools(server_args, model_config, gpu_memory_bytes)
    except ValueError as error:
        raise SystemExit(f"bench_one_batch: {error}; change --mem-fraction-static or --max-total-tokens") from None
    context_len = server_args.context_length or model_config.context_len
    capacity = PoolCapacity(plan.full_tokens, plan.swa_tokens, server_args.max_running_requests, context_len)
    for need in needs:
        problems = misfits(need, capacity)
        fixes = {
            "pools": remedies(need, plan, server_args),
            "rows": f"--max-running-requests {need.batch_size}",
            "context": f"--context-length {need.request_tokens}",
        }
        if problems:
            raise SystemExit(
                f"bench_one_batch: {server_args.model_path}: {'; '.join(problems.values())}. The pools are sized"
                f" from {source}: {plan.summary()}. Fits with: {'; '.join(fixes[kind] for kind in problems)}."
            )


def check_runner(runner: ModelRunner, needs: list[BatchNeed]) -> None:
    """The same check on the pools the runner built (its weights counted exactly), before any forward."""
    allocator, rows = runner.token_allocator, runner.req_to_token_pool.max_requests
    capacity = PoolCapacity(allocator.full_size, allocator.swa_size, rows, runner.context_len)
    for need in needs:
        problems = misfits(need, capacity)
        if problems:
            raise SystemExit(f"bench_one_batch: {'; '.join(problems.values())}; {runner.memory_plan.summary()}")


def built_runner(server_args: ServerArgs, needs: list[BatchNeed]) -> ModelRunner:
    """The runner, its pools checked against `needs` as built (`refuse_unfit` checked the plan beforehand)."""
    runner = ModelRunner(server_args)
    check_runner(runner, needs)
    return runner


def kv_pools(runner: ModelRunner) -> dict:
    """What the runner's KV pools were sized from and how many tokens they hold (for the JSON)."""
    plan = runner.memory_plan
    return {"full_tokens": plan.full_tokens, "swa_tokens": plan.swa_tokens, "sized_by": plan.sized_by}
