"""What the KV pools store: the model's dtype (`--kv-cache-dtype auto`) or FP8 with per-tensor scales.

`fp8_e4m3` stores each K/V element as float8_e4m3fn, one byte, so the same memory holds twice the tokens of
bf16. Every KV-owning layer has two float32 per-tensor scales, k and v (SGLang's and vLLM's scheme; the
element math is kernels/kv_quant.py): stored = clamp(value / scale, +-448), value ~ stored * scale.

The scales come from the checkpoint when it gives them (`model_loader/kv_scales.py`: compressed-tensors and
vLLM exports name them `...self_attn.k_scale` / `v_scale` or `...k_proj.output_scale` / `v_proj.output_scale`),
else DEFAULT_KV_SCALE = 1.0, vLLM's default: Gemma 4's K is RMS-normed (|k| ~ 1 per element, times the norm
weight) and V is normed without a weight, so unscaled values sit well inside e4m3's range (+-448, 3
mantissa bits: a relative rounding error of at most 2^-4 for values above 2^-6).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.kv_quant import FP8_KV_DTYPE
from srt.server_args import KV_CACHE_DTYPES

DEFAULT_KV_SCALE = 1.0


class KVScales(NamedTuple):
    """Per-tensor scales of one layer's K and V buffers (1.0 on unquantized pools: stored = real value)."""

    k: float
    v: float


UNIT_SCALES = KVScales(DEFAULT_KV_SCALE, DEFAULT_KV_SCALE)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' element dtype for `--kv-cache-dtype`: `auto` keeps the model's dtype."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")


def as_float32(scale: float) -> float:
    """A scale as the float32 the kernels compute with (a Python float is a double)."""
    return float(torch.tensor(scale, dtype=torch.float32))
