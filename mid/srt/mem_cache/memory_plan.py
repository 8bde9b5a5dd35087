"""How many tokens the full and sliding-window KV pools get, from a memory budget.

    device memory * mem_fraction_static
    ├── weights (counted exactly: the transformers model built on the meta device)
    └── KV budget = full_tokens * full_bytes_per_token + swa_tokens * swa_bytes_per_token
                    with swa_tokens = swa_full_tokens_ratio * full_tokens

Sliding layers keep at most a window of KV per request, so the SWA pool needs far fewer tokens than the
full pool. The ratio defaults to 0.15 for MoE checkpoints (26B-A4B: many sliding layers with 8 KV heads make
SWA tokens expensive) and 0.8 for dense ones; a user's value always wins.

Bytes per token follow the pools' element dtype: the model's (`--kv-cache-dtype auto`) or one byte per element
for FP8 (`fp8_e4m3`), which fits twice the bf16 tokens in the same budget (its float32 scales, two per layer,
are noise). The summary line names the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from transformers import Gemma4ForCausalLM

from srt.configs.model_config import ModelConfig
from srt.mem_cache.kv_pool import kv_bytes_per_token, layer_kv_bytes

DEFAULT_SWA_RATIO_MOE = 0.15
DEFAULT_SWA_RATIO_DENSE = 0.8
RULE_USER = "user"
RULE_MOE = "default for MoE checkpoints"
RULE_DENSE = "default for dense checkpoints"


class SWARatio(NamedTuple):
    """swa_full_tokens_ratio and the rule that chose it."""

    value: float
    rule: str


def choose_swa_ratio(model_config: ModelConfig, user_ratio: float | None) -> SWARatio:
    """The user's ratio if given, else the default for the checkpoint's kind (MoE or dense)."""
    if user_ratio is not None:
        if not 0 < user_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1]; got {user_ratio}")
        return SWARatio(user_ratio, RULE_USER)
    if model_config.is_moe:
        return SWARatio(DEFAULT_SWA_RATIO_MOE, RULE_MOE)
    return SWARatio(DEFAULT_SWA_RATIO_DENSE, RULE_DENSE)


def count_weight_bytes(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the text model's parameters in `dtype`, counted on transformers' own module tree.

    Built on the meta device, so nothing is allocated; `parameters()` yields a tied lm_head only once.
    """
    with torch.device("meta"):
        model = Gemma4ForCausalLM(model_config.hf_text_config)
    return sum(param.numel() for param in model.parameters()) * dtype.itemsize


@dataclass(frozen=True)
class MemoryPlan:
    """Sizes of the two KV pools and where they came from."""

    weight_bytes: int
    kv_budget_bytes: int  # bytes the pools may use (what the weights leave, or what max_total_tokens needs)
    full_bytes_per_token: int  # K+V of one token over the full-attention layers that own KV
    swa_bytes_per_token: int  # K+V of one token over the sliding layers that own KV
    full_tokens: int
    swa_tokens: int
    swa_full_tokens_ratio: float
    ratio_rule: str  # RULE_USER, RULE_MOE or RULE_DENSE
    sized_by: str  # "mem_fraction_static" or "max_total_tokens"
    kv_dtype: torch.dtype  # the pools' element dtype (float8_e4m3fn: --kv-cache-dtype fp8_e4m3)

    @property
    def kv_bytes(self) -> int:
        return self.full_tokens * self.full_bytes_per_token + self.swa_tokens * self.swa_bytes_per_token

    def summary(self) -> str:
        """The log line: pool sizes and which rule chose the ratio."""
        return (
            f"KV pools ({self.sized_by}): full {self.full_tokens} tokens x {self.full_bytes_per_token} B, "
            f"swa {self.swa_tokens} tokens x {self.swa_bytes_per_token} B = {self.kv_bytes / 2**30:.2f} GiB "
            f"of {str(self.kv_dtype).removeprefix('torch.')} KV "
            f"(weights {self.weight_bytes / 2**30:.2f} GiB); swa_full_tokens_ratio {self.swa_full_tokens_ratio} "
            f"({self.ratio_rule})"
        )


def plan_memory(
    model_config: ModelConfig,
    dtype: torch.dtype,
    weight_bytes: int,
    *,
    device_memory_bytes: int | None = None,
    mem_fraction_static: float = 0.85,
    max_total_tokens: int | None = None,
    swa_full_tokens_ratio: float | None = None,
    kv_dtype: torch.dtype | None = None,
) -> MemoryPlan:
    """Pool sizes from `max_total_tokens` (full-pool tokens) if given, else from the device's memory.

    `dtype` is the weights'; `kv_dtype` the pools' elements (default: `dtype`; float8_e4m3fn for an FP8 cache).

    Raises ValueError when the weights leave no room for KV, or when `max_total_tokens` does not fit in
    the device memory given alongside it.
    """
    ratio = choose_swa_ratio(model_config, swa_full_tokens_ratio)
    kv_dtype = kv_dtype or dtype
    full_bpt, swa_bpt = kv_bytes_per_token(model_config.layers, kv_dtype)
    budget = None
    if device_memory_bytes is not None:
        if not 0 < mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1]; got {mem_fraction_static}")
        usable = int(device_memory_bytes * mem_fraction_static)
        budget = usable - weight_bytes
        if budget <= 0:
            raise ValueError(
                f"weights take {weight_bytes / 2**30:.2f} GiB of {usable / 2**30:.2f} GiB "
                f"(mem_fraction_static {mem_fraction_static}): no memory left for the KV cache"
            )
    if max_total_tokens is not None:
        full_tokens, sized_by = max_total_tokens, "max_total_tokens"
    elif budget is not None:
        # The largest full_tokens with full_tokens * (full_bpt + ratio * swa_bpt) <= budget.
        full_tokens, sized_by = int(budget // (full_bpt + ratio.value * swa_bpt)), "mem_fraction_static"
    else:
        raise ValueError("give device_memory_bytes or max_total_tokens to size the KV pools")
    swa_tokens = int(ratio.value * full_tokens)
    plan = MemoryPlan(
        weight_bytes=weight_bytes,
        kv_budget_bytes=budget if budget is not None else 0,
        full_bytes_per_token=full_bpt,
        swa_bytes_per_token=swa_bpt,
        full_tokens=full_tokens,
        swa_tokens=swa_tokens,
        swa_full_tokens_ratio=ratio.value,
        ratio_rule=ratio.rule,
        sized_by=sized_by,
        kv_dtype=kv_dtype,
    )
    if budget is None:
        return replace(plan, kv_budget_bytes=plan.kv_bytes)
    if plan.kv_bytes > budget:
        raise ValueError(
            f"max_total_tokens {max_total_tokens} needs {plan.kv_bytes / 2**30:.2f} GiB of KV but only "
            f"{budget / 2**30:.2f} GiB are left after the weights"
        )
    return plan


class Concurrency(NamedTuple):
    """How many requests of one context length fit at once, here and in a naive layout."""

    context_len: int
    requests: int  # this layout: L full-pool tokens and min(L, window) SWA tokens per request
    limited_by: str  # "full pool" or "swa pool"
    naive_bytes_per_token: int  # every layer (KV-shared ones too) storing K and V
    naive_requests: int  # the same KV budget spent on full-length KV in every layer


def concurrency(plan: MemoryPlan, model_config: ModelConfig, context_len: int) -> Concurrency:
    """Requests of `context_len` tokens that fit in the planned pools, beside a naive layout (same KV dtype).

    A running request holds SWA KV only for the last W-1 tokens plus the one being computed (older tokens
    are freed after each step), so it needs min(L, W) SWA slots once its prefill is done.
    """
    window = model_config.sliding_window
    by_full = plan.full_tokens // context_len
    by_swa = plan.swa_tokens // min(context_len, window) if plan.swa_bytes_per_token else by_full
    naive_bpt = sum(layer_kv_bytes(spec, plan.kv_dtype) for spec in model_config.layers)
    return Concurrency(
        context_len=context_len,
        requests=min(by_full, by_swa),
        limited_by="full pool" if by_full <= by_swa else "swa pool",
        naive_bytes_per_token=naive_bpt,
        naive_requests=plan.kv_budget_bytes // (naive_bpt * context_len),
    )
