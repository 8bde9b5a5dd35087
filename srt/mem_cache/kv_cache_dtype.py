"""What the KV pools store: the model's dtype (`--kv-cache-dtype auto`) or FP8 with per-tensor scales.

`fp8_e4m3` stores each K/V element as float8_e4m3fn, one byte, so the same memory holds twice the tokens of
bf16. Every KV-owning layer has two float32 per-tensor scales (SGLang's and vLLM's scheme):

    store:  q = clamp(x / scale, -448, 448) cast to float8_e4m3fn     (448: e4m3fn's largest finite value)
    read:   x ~ float(q) * scale

The scales come from the checkpoint when it gives them (`model_loader/kv_scales.py`: compressed-tensors and
vLLM exports name them `...self_attn.k_scale` / `v_scale` or `...k_proj.output_scale` / `v_proj.output_scale`),
else DEFAULT_KV_SCALE = 1.0, vLLM's default: Gemma 4's K is RMS-normed (|k| ~ 1 per element, times the norm
weight) and V is normed without a weight, so unscaled values sit well inside e4m3's range.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: the cast does not saturate, so values are clamped
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


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def as_float32(scale: float) -> float:
    """A scale as the float32 the kernels compute with (a Python float is a double)."""
    return float(torch.tensor(scale, dtype=torch.float32))


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn of x / scale, clamped to +-448 (the reference of the store kernel's rounding)."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def to_buffer(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a KV buffer of `dtype` stores it: quantized with `scale` for FP8, else a plain cast."""
    return quantize_kv(x, scale) if is_fp8_kv(dtype) else x.to(dtype)


def from_buffer(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """KV rows read back in `dtype`: FP8 dequantized (float32 times the scale, then rounded once), else a cast."""
    if is_fp8_kv(stored.dtype):
        return (stored.float() * scale).to(dtype)
    return stored.to(dtype)
