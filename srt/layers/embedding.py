"""Gemma 4's scaled token embeddings (the token table and, on E2B/E4B, the per-layer table)."""

from __future__ import annotations

import torch
from torch import nn

from srt.kernels.embedding import scaled_embedding


class ScaledEmbedding(nn.Embedding):
    """Embedding times a constant; the constant is rounded to the weight dtype first, as the reference does.
    One Triton gather + scale on GPU (`kernels/embedding.py`), for any table layout."""

    def __init__(self, num_embeddings: int, dim: int, scale: float) -> None:
        super().__init__(num_embeddings, dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.weight, ids, self.scale)
