"""The batched image encoder: vision tower calls per bucket of same-size images, one embedder call for all.

A per-image loop (one tower call and one embedder call per image) leaves the GPU mostly idle on small
images. Here the images a forward needs and that are not cached yet are

    bucketed by patch count          same count -> one [B, n, 768] tensor, no padding, no mask
    each bucket chunked by a budget  activation bytes of a call stay under --mm-encoder-budget-mb
    one tower call per chunk
    one embedder call                over every new image's soft tokens at once

and their embeddings are cached by content hash (LRU, --mm-embedding-cache-tokens), so a repeated image, the
next chunk of a prompt split inside an image, or a retracted request's re-prefill is not encoded again.
`--disable-batched-mm-encoder` keeps the per-image loop for A/B runs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from srt.multimodal.inputs import ImageEmbeds, ImageItem, MultimodalBatch

if TYPE_CHECKING:
    from srt.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower


def activation_bytes(tower: Gemma4VisionTower, num_patches: int, dtype: torch.dtype) -> int:
    """A generous estimate of one image's activation memory in a tower call: a layer's projections and MLP, and
    one attention score matrix per head (what SDPA's math fallback holds; flash attention holds less)."""
    config = tower.config
    elem = torch.finfo(dtype).bits // 8
    linear = num_patches * (4 * config.hidden_size + 2 * config.intermediate_size) * elem
    return linear + config.num_attention_heads * num_patches * num_patches * 4


def chunks_under_budget(items: list[ImageItem], per_image_bytes: int, budget_bytes: int) -> list[list[ImageItem]]:
    """Consecutive groups of one bucket whose activations fit the budget (at least one image per group)."""
    per_chunk = max(1, budget_bytes // max(1, per_image_bytes))
    return [items[i : i + per_chunk] for i in range(0, len(items), per_chunk)]


class ImageEncoder:
    """Images -> text-space embeddings on the model's device, with a cache by content hash."""

    def __init__(
        self,
        tower: Gemma4VisionTower,
        embedder: Gemma4VisionEmbedder,
        budget_bytes: int,
        cache_tokens: int,
        batched: bool = True,
    ) -> None:
        self.tower = tower
        self.embedder = embedder
        self.budget_bytes = budget_bytes
        self.cache_tokens = cache_tokens
        self.batched = batched
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._cached_tokens = 0
        self.images_encoded = 0  # over the encoder's life (metrics, tests)

    @property
    def _param(self) -> torch.Tensor:
        return self.embedder.embedding_projection.weight

    def image_embeds(self, batch: MultimodalBatch) -> ImageEmbeds:
        """The embeddings of every image row of a forward batch."""
        embeddings = self.encode(batch.items)
        device = self._param.device
        rows = torch.cat([torch.arange(r.batch_row, r.batch_row + r.count) for r in batch.rows]).to(device)
        parts = [embeddings[r.item.content_hash][r.first : r.first + r.count] for r in batch.rows]
        return ImageEmbeds(rows, torch.cat(parts))

    @torch.no_grad()
    def encode(self, items: list[ImageItem]) -> dict[int, torch.Tensor]:
        """Embeddings ([num_tokens, text hidden]) of each image by content hash; cached ones are not encoded."""
        wanted = {item.content_hash: item for item in items}
        found = {h: self._cache[h] for h in wanted if h in self._cache}
        for h in found:
            self._cache.move_to_end(h)
        missing = [item for h, item in wanted.items() if h not in found]
        if missing:
            new = self._encode_batched(missing) if self.batched else self._encode_one_by_one(missing)
            found.update(new)
            for h, embedding in new.items():
                self._remember(h, embedding, keep=wanted)
        return found

    def _tower(self, items: list[ImageItem]) -> torch.Tensor:
        """One tower call over same-size images: [len(items) * tokens each, vision hidden] in the model dtype."""
        device, dtype = self._param.device, self._param.dtype
        patches = torch.from_numpy(np.stack([item.patches for item in items])).to(device)
        positions = torch.from_numpy(np.stack([item.positions for item in items])).to(device)
        return self.tower(patches, positions).to(dtype).flatten(0, 1)

    def _encode_batched(self, items: list[ImageItem]) -> dict[int, torch.Tensor]:
        buckets: dict[int, list[ImageItem]] = {}
        for item in items:
            buckets.setdefault(item.num_patches, []).append(item)
        order, soft_tokens = [], []
        for num_patches, bucket in buckets.items():
            per_image = activation_bytes(self.tower, num_patches, self._param.dtype)
            for chunk in chunks_under_budget(bucket, per_image, self.budget_bytes):
                soft_tokens.append(self._tower(chunk))
                order.extend(chunk)
        embedded = self.embedder(torch.cat(soft_tokens))
        self.images_encoded += len(order)
        pieces = embedded.split([item.num_tokens for item in order])
        return {item.content_hash: piece for item, piece in zip(order, pieces, strict=True)}

    def _encode_one_by_one(self, items: list[ImageItem]) -> dict[int, torch.Tensor]:
        self.images_encoded += len(items)
        return {item.content_hash: self.embedder(self._tower([item])) for item in items}

    def _remember(self, content_hash: int, embedding: torch.Tensor, keep: dict[int, ImageItem]) -> None:
        """Cache an embedding; evict least recently used ones, never those the current batch needs."""
        self._cache[content_hash] = embedding
        self._cached_tokens += embedding.shape[0]
        for old in list(self._cache):
            if self._cached_tokens <= self.cache_tokens:
                break
            if old not in keep:
                self._cached_tokens -= self._cache.pop(old).shape[0]

    def check_integrity(self) -> None:
        """The token count the cache keeps equals the sum of its entries."""
        total = sum(embedding.shape[0] for embedding in self._cache.values())
        if total != self._cached_tokens:
            raise AssertionError(f"image cache counts {self._cached_tokens} tokens, holds {total}")
