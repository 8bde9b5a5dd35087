"""Rotary position embeddings per layer type.

Sliding layers use default RoPE (theta 10k over the whole head); full layers use proportional RoPE (theta
1M, only `partial_rotary_factor` of the frequencies non-zero). The inverse frequencies come from
transformers' own Gemma 4 rotary module, so they follow the checkpoint's `rope_parameters` exactly.
"""

from __future__ import annotations

import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding


class RotaryEmbedding:
    """cos/sin tables per layer type, computed on the fly from positions."""

    def __init__(self, config: Gemma4TextConfig) -> None:
        # built on the CPU even when the model is built on the meta device: these are not weights
        with torch.device("cpu"):
            reference = Gemma4TextRotaryEmbedding(config)
        self.layer_types = sorted(set(config.layer_types))
        self._inv_freq = {t: getattr(reference, f"{t}_inv_freq").detach().float() for t in self.layer_types}

    def cos_sin(
        self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, head_dim] cos and sin for the given positions, cast to `dtype`."""
        inv_freq = self._inv_freq[layer_type]
        if inv_freq.device != positions.device:
            inv_freq = self._inv_freq[layer_type] = inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token cos/sin [tokens, head_dim] (rotate-half layout)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
