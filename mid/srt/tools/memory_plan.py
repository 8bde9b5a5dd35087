"""Print the KV memory plan of a model on a GPU of a given size, as JSON.

    python -m srt.tools.memory_plan --model gemma-4-E4B-it --gpu-memory-gb 80 --context-len 8192
    python -m srt.tools.memory_plan --model gemma-4-E4B-it --gpu-memory-gb 80 --kv-cache-dtype fp8_e4m3

Reports the weight bytes, KV bytes per token of each pool, both pool sizes, the swa_full_tokens_ratio and the
rule that chose it, and how many requests of `--context-len` tokens fit at once, beside a naive layout in
which every layer (KV-shared ones included) stores K and V for all tokens. GPU memory is in GiB (2**30 B).
`--kv-cache-dtype fp8_e4m3` sizes FP8 pools (one byte per element: about twice the tokens of bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

import torch

from srt.configs.model_config import ModelConfig, resolve_dtype
from srt.mem_cache.kv_cache_dtype import resolve_kv_cache_dtype
from srt.mem_cache.memory_plan import MemoryPlan, concurrency, count_weight_bytes, plan_memory
from srt.server_args import KV_CACHE_DTYPES, ServerArgs

logger = logging.getLogger("srt.memory_plan")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerArgs)}


def build_report(
    model: str,
    gpu_memory_gb: float,
    dtype_name: str = "bfloat16",
    context_len: int | None = None,
    mem_fraction_static: float = _DEFAULTS["mem_fraction_static"],
    swa_full_tokens_ratio: float | None = None,
    max_total_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """The JSON-ready report the CLI prints."""
    model_config = ModelConfig.from_name_or_path(model)
    dtype = resolve_dtype(dtype_name, torch.device("cuda"))  # a GPU plan: `auto` means bfloat16
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    weight_bytes = count_weight_bytes(model_config, dtype)
    context_len = context_len or model_config.context_len

    def plan_with(ratio: float | None) -> MemoryPlan:
        return plan_memory(
            model_config,
            dtype,
            weight_bytes,
            device_memory_bytes=int(gpu_memory_gb * 2**30),
            mem_fraction_static=mem_fraction_static,
            max_total_tokens=max_total_tokens,
            swa_full_tokens_ratio=ratio,
            kv_dtype=kv_dtype,
        )

    plan = plan_with(swa_full_tokens_ratio)
    logger.info(plan.summary())
    fit = concurrency(plan, model_config, context_len)
    # For comparison: the ratio at which both pools run out together when every request has context_len tokens.
    matched_ratio = min(context_len, model_config.sliding_window) / context_len
    matched = plan_with(matched_ratio)
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "gpu_memory_bytes": int(gpu_memory_gb * 2**30),
        "mem_fraction_static": mem_fraction_static,
        "weight_bytes": plan.weight_bytes,
        "kv_budget_bytes": plan.kv_budget_bytes,
        "kv_bytes_per_token": {
            "full_pool": plan.full_bytes_per_token,
            "swa_pool": plan.swa_bytes_per_token,
            "naive_all_layers": fit.naive_bytes_per_token,
        },
        "full_pool_tokens": plan.full_tokens,
        "swa_pool_tokens": plan.swa_tokens,
        "swa_full_tokens_ratio": plan.swa_full_tokens_ratio,
        "ratio_rule": plan.ratio_rule,
        "sized_by": plan.sized_by,
        "sliding_window": model_config.sliding_window,
        "context_len": context_len,
        "concurrent_requests": fit.requests,
        "limited_by": fit.limited_by,
        "naive_concurrent_requests": fit.naive_requests,
        "extra_requests_vs_naive": fit.requests - fit.naive_requests,
        "with_ratio_matched_to_context": {
            "swa_full_tokens_ratio": round(matched_ratio, 6),
            "full_pool_tokens": matched.full_tokens,
            "swa_pool_tokens": matched.swa_tokens,
            "concurrent_requests": concurrency(matched, model_config, context_len).requests,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m srt.tools.memory_plan", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="preset name (e.g. gemma-4-E4B-it) or checkpoint directory")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="GPU memory in GiB")
    parser.add_argument("--context-len", type=int, default=None, help="tokens per request (default: the model's)")
    parser.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--mem-fraction-static", type=float, default=_DEFAULTS["mem_fraction_static"])
    parser.add_argument("--swa-full-tokens-ratio", type=float, default=None)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        report = build_report(
            args.model,
            args.gpu_memory_gb,
            args.dtype,
            args.context_len,
            args.mem_fraction_static,
            args.swa_full_tokens_ratio,
            args.max_total_tokens,
            args.kv_cache_dtype,
        )
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
