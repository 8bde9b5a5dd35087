"""Gemma 4's scaled token embeddings (the token table and, on E2B/E4B, the per-layer table)."""

from __future__ import annotations

import torch
from torch import nn

from srt.distributed.collectives import vocab_parallel_rows
from srt.kernels.embedding import scale_in_dtype, scaled_embedding


class ScaledEmbedding(nn.Embedding):
    """Embedding times a constant; the constant is rounded to the weight dtype first, as the reference does.
    One Triton gather + scale on GPU (`kernels/embedding.py`), for any table layout.

    Under tensor parallelism (`tp_size` > 1) the table holds this rank's slice of the vocabulary (rows
    [tp_rank * rows, (tp_rank + 1) * rows)) and a lookup sums every rank's rows (`vocab_parallel_rows`)."""

    def __init__(self, num_embeddings: int, dim: int, scale: float, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(num_embeddings, dim)
        self.scale = scale
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The unscaled rows of `ids` (any rank's)."""
        return vocab_parallel_rows(self.weight, ids, self.tp_rank, self.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            return self.rows(ids) * scale_in_dtype(self.scale, self.weight.dtype)
        return scaled_embedding(self.weight, ids, self.scale)
