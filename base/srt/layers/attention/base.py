"""The attention-backend interface the model calls."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from srt.configs.model_config import AttentionLayerSpec
from srt.forward.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention of a batch's query rows over each request's KV in the pools.

    `init_forward_metadata` runs once per forward (and again for a row subset, as YOCO does) and stores
    what the backend needs in `batch.attn_metadata`; `forward` runs once per layer.
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-forward metadata (index tensors, lengths) in `batch.attn_metadata`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """Attention output [tokens, heads, head_dim] for q [tokens, heads, head_dim] over the layer's KV.

        The batch's new tokens' K/V are in the pool already: a KV-owning layer writes them before it calls
        this (fused with its q/k/v norms, `kernels/qkv_store.py`). A KV-shared layer reads its owner's
        buffers; the pool resolves whose.
        """
