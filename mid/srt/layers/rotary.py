"""Rotary position embeddings per layer type.

Sliding layers use default RoPE (theta 10k over the whole head); full layers use proportional RoPE (theta
1M, only `partial_rotary_factor` of the frequencies non-zero). The inverse frequencies come from
transformers' own Gemma 4 rotary module, so they follow the checkpoint's `rope_parameters` exactly. The
tables come from `kernels/rope.py` (one kernel per layer type on GPU).
"""

from __future__ import annotations

import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from srt.kernels.rope import rope_cos_sin


class RotaryEmbedding:
    """cos/sin tables per layer type, computed on the fly from positions."""

    def __init__(self, config: Gemma4TextConfig) -> None:
        # built on the CPU even when the model is built on the meta device: these are not weights
        with torch.device("cpu"):
            reference = Gemma4TextRotaryEmbedding(config)
        self.layer_types = sorted(set(config.layer_types))
        self._inv_freq = {t: getattr(reference, f"{t}_inv_freq").detach().float() for t in self.layer_types}

    def inv_freq(self, layer_type: str, device: torch.device) -> torch.Tensor:
        """The float32 inverse frequencies of `layer_type`, moved to `device` once."""
        inv_freq = self._inv_freq[layer_type]
        if inv_freq.device != device:
            inv_freq = self._inv_freq[layer_type] = inv_freq.to(device)
        return inv_freq

    def cos_sin(
        self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype, use_triton: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, head_dim] cos and sin for the given positions, cast to `dtype`."""
        return rope_cos_sin(positions, self.inv_freq(layer_type, positions.device), dtype, use_triton)
