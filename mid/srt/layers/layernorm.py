"""RMSNorm as Gemma 4 defines it: computed in float32, weight multiplied directly (no `1 + weight`)."""

from __future__ import annotations

import torch
from torch import nn

from srt.kernels.norm import rms_norm, rms_norm_reference


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight; `with_scale=False` is Gemma 4's scale-free norm (v_norm, router).
    One Triton kernel on GPU (`kernels/norm.py`), the torch reference elsewhere."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    @property
    def scale(self) -> torch.Tensor | None:
        """The weight the kernels take: None for the scale-free norm."""
        return self.weight if self.with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale, self.eps)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU, and the oracle of the GPU kernel)."""
        return rms_norm_reference(x, self.scale, self.eps)
