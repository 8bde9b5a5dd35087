"""Inputs and bf16 checks shared by the kernel tests.

bf16 checks are in ulps of the magnitudes that get rounded: the kernels round where torch rounds (except RoPE,
which rounds once from float32: kernels/rope.py), and float32 noise (summation order, exp vs tanh) may flip a
rounded bf16 bit.
"""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def bf16_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values (8 significant bits) at |magnitude|, elementwise, in float32."""
    exponent = torch.floor(torch.log2(magnitude.float().abs().clamp_min(2.0**-120)))
    return torch.pow(2.0, exponent - 7)


def assert_within_ulps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, ulps: float) -> None:
    """|got - expected| <= ulps bf16 ulps of `magnitude` (the size of what was rounded), elementwise."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    error = (got.float() - expected.float()).abs()
    bound = ulps * bf16_ulp(magnitude)
    worst = (error / bound).max().item() if error.numel() else 0.0
    assert bool((error <= bound).all()), f"off by up to {worst:.2f} x {ulps} ulps"


def random_weight(dim: int, generator: torch.Generator) -> torch.Tensor:
    return 1 + 0.3 * torch.randn(dim, generator=generator)


def cos_sin(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default-RoPE tables as RotaryEmbedding.cos_sin builds them, at scattered positions."""
    positions = torch.arange(tokens, dtype=torch.float32) * 37 + 5
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def projection_heads(
    tokens: int, heads: int, dim: int, dtype: torch.dtype, strided: bool, generator: torch.Generator
) -> torch.Tensor:
    """[tokens, heads, dim]; `strided`: the k part of a fused q/k/v GEMM output viewed per head, as the model does."""
    if not strided:
        return (3 * torch.randn(tokens, heads, dim, generator=generator)).to(DEVICE, dtype)
    qkv = (3 * torch.randn(tokens, (2 * heads + 1) * dim, generator=generator)).to(DEVICE, dtype)
    _, k, _ = qkv.split([heads * dim, heads * dim, dim], dim=-1)
    x = k.view(tokens, heads, dim)
    assert x.storage_offset() == heads * dim  # an offset view with row stride (2 * heads + 1) * dim
    return x
