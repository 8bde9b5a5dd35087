"""FP8 projections for the tests: a random weight quantized as a checkpoint would be, and the error measure the
FP8 tests bound (no scheduler imports: the kernel tests use it too)."""

from __future__ import annotations

import torch

from srt.layers.fp8_linear import Fp8Linear
from srt.model_loader.fp8 import Fp8Scheme, quantize


def fp8_layer(n: int, k: int, strategy: str, device: str = "cpu", seed: int = 0) -> Fp8Linear:
    """A random [n, k] weight quantized per channel ("channel") or in 128 x 128 blocks ("block")."""
    weight = torch.randn(n, k, generator=torch.Generator(device).manual_seed(seed), device=device) / k**0.5
    q, scale = quantize(weight, Fp8Scheme(strategy))
    layer = Fp8Linear(k, n, None if strategy == "channel" else (128, 128), device=device)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(layer.scale_from_checkpoint(scale))
    return layer


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest absolute error over the largest expected magnitude."""
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())
