"""The attention-backend interface the model calls."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from srt.configs.model_config import AttentionLayerSpec
from srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention of a batch's query rows over each request's KV in the pools.

    `init_forward_metadata` runs once per forward (and again for a row subset, as YOCO does) and stores
    what the backend needs in `batch.attn_metadata`; `forward` runs once per layer.
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-forward metadata (index tensors, lengths) in `batch.attn_metadata`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerSpec,
        batch: ForwardBatch,
        save_kv: bool = True,
    ) -> torch.Tensor:
        """Attention output [tokens, heads, head_dim] for q [tokens, heads, head_dim].

        When `save_kv`, k and v ([tokens, kv_heads, head_dim]) of the batch's new tokens are first written
        to the layer's pool at `batch.out_cache_loc`. A KV-shared layer passes no k/v and reads its owner's
        buffers; the pool resolves whose. (Gemma 4's KV-owning layers write their K/V themselves, fused with
        the q/k/v norms, and pass no k/v either.)
        """
