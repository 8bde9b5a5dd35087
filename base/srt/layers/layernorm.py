"""RMSNorm as Gemma 4 defines it: computed in float32, weight multiplied directly (no `1 + weight`)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight; `with_scale=False` is Gemma 4's scale-free norm (v_norm, router)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from srt.layers.rms_norm_kernel import fused_rms_norm  # triton is only needed on GPU

            return fused_rms_norm(x, self.weight if self.with_scale else None, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU, and the oracle of the fused GPU kernel)."""
        x32 = x.float()
        # pow(-0.5) rather than rsqrt, as the reference does, to stay bit-close to it
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            normed = normed * self.weight.float()
        return normed.type_as(x)
