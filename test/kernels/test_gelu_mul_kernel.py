"""kernels/gelu_mul.py: gelu(gate, tanh) * up against torch's ops (Triton's interpreter on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import DEVICE, assert_within_ulps, bf16_ulp

from srt.kernels.gelu_mul import gelu_tanh_mul, gelu_tanh_mul_packed, gelu_tanh_mul_reference


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("layout", ["packed", "halves", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_kernel(tokens: int, layout: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(tokens)
    n = 48
    gate_up = (3 * torch.randn(tokens, 2 * n, generator=generator)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    if layout == "packed":
        got = gelu_tanh_mul_packed(gate_up, use_triton=True)
    elif layout == "halves":  # row stride 2n, no copy
        got = gelu_tanh_mul(gate, up, use_triton=True)
    else:
        got = gelu_tanh_mul(gate.contiguous(), up.contiguous(), use_triton=True)
    assert got.shape == (tokens, n) and got.dtype == dtype
    expected = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(gelu_tanh_mul_reference(gate, up), expected)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    # float64 gelu in the cancellation-free form, rounded where torch rounds: what the kernel computes
    g64 = gate.double()
    gelu64 = g64 * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64**3))
    oracle = (gelu64.to(dtype).float() * up.float()).to(dtype)
    magnitude = gelu64.abs() * up.double().abs()
    assert_within_ulps(got, oracle, magnitude, 1)
    assert (got == oracle).float().mean() >= 0.95
    # torch's 0.5 * g * (1 + tanh) cancels for negative g: allow its float32 error (~2^-23 of |g * up|)
    error = (got.float() - expected.float()).abs()
    assert bool((error <= bf16_ulp(magnitude) + (gate.float() * up.float()).abs() * 2.0**-22).all())


def test_zero_tokens() -> None:
    assert gelu_tanh_mul_packed(torch.empty(0, 96, device=DEVICE), use_triton=True).shape == (0, 48)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU default is the torch reference")
def test_cpu_default_is_the_reference() -> None:
    rows = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(gelu_tanh_mul_packed(rows), gelu_tanh_mul_reference(*rows.chunk(2, dim=-1)))
