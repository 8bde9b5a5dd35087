"""FP8 K/V elements (`--kv-cache-dtype fp8_e4m3`): the torch reference of what the store kernel writes and the
attention kernels read, per tensor with one float32 scale:

    store:  q = clamp(x / scale, -448, 448) cast to float8_e4m3fn     (448: e4m3fn's largest finite value)
    read:   x ~ float(q) * scale

The kernels round and dequantize the same way (qkv_store.py, attention/); which scale a layer uses is the
pool's business (mem_cache/kv_cache_dtype.py).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: torch's cast does not saturate, so values are clamped


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn of x / scale, clamped to +-448 (the reference of the store kernel's rounding)."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def to_buffer(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a KV buffer of `dtype` stores it: quantized with `scale` for FP8, else a plain cast."""
    return quantize_kv(x, scale) if is_fp8_kv(dtype) else x.to(dtype)


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """buffer[rows] = values as the buffer stores them (`to_buffer`). FP8 rows are written through a uint8 view:
    torch builds without float8 indexing kernels exist (CUDA's came late), and a byte copy is the same."""
    stored = to_buffer(values, buffer.dtype, scale)
    if is_fp8_kv(buffer.dtype):
        buffer.view(torch.uint8)[rows] = stored.view(torch.uint8)
    else:
        buffer[rows] = stored


def read_rows(buffer: torch.Tensor, rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """buffer[rows] in `dtype` (`from_buffer`), FP8 gathered through a uint8 view as in `write_rows`."""
    if is_fp8_kv(buffer.dtype):
        return from_buffer(buffer.view(torch.uint8)[rows].view(buffer.dtype), scale, dtype)
    return from_buffer(buffer[rows], scale, dtype)


def from_buffer(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """KV rows read back in `dtype`: FP8 dequantized (float32 times the scale, then rounded once), else a cast."""
    if is_fp8_kv(stored.dtype):
        return (stored.float() * scale).to(dtype)
    return stored.to(dtype)
