"""Gemma 4 with image input: the text model of `models/gemma4.py` plus the vision tower and `embed_vision`.

A forward whose batch computes image placeholder rows (`ForwardBatch.mm`) first gets those rows' embeddings from
the batched, caching encoder (`multimodal/encoder.py`), then runs the text model with them scattered into the
placeholder rows. A text-only batch runs exactly as on a text-only checkpoint.

Parameter names: the checkpoint's `model.vision_tower.*` and `model.embed_vision.*` load into `vision_tower.*`
and `embed_vision.*` (`model_loader/weight_names.py`); the text model keeps `model.*`.
"""

from __future__ import annotations

import torch

from srt.configs.model_config import ModelConfig
from srt.forward.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend
from srt.layers.logits_processor import LogitsOutput
from srt.models.gemma4 import Gemma4ForCausalLM
from srt.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower
from srt.multimodal.encoder import ImageEncoder
from srt.multimodal.inputs import ImageEmbeds

DEFAULT_ENCODER_BUDGET_BYTES = 2 << 30
DEFAULT_CACHE_TOKENS = 8192


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Text model, LM head, vision tower and image embedder."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        vision = config.vision_config
        self.vision_tower = Gemma4VisionTower(vision)
        self.embed_vision = Gemma4VisionEmbedder(vision.hidden_size, config.hidden_size, vision.rms_norm_eps)
        self.image_encoder = ImageEncoder(
            self.vision_tower, self.embed_vision, DEFAULT_ENCODER_BUDGET_BYTES, DEFAULT_CACHE_TOKENS
        )

    def configure_encoder(self, budget_bytes: int, cache_tokens: int, batched: bool) -> None:
        """The encoder's memory budget per tower call, its cache size, and batched vs per-image (A/B)."""
        self.image_encoder = ImageEncoder(self.vision_tower, self.embed_vision, budget_bytes, cache_tokens, batched)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, images: ImageEmbeds | None = None
    ) -> LogitsOutput:
        if batch.mm is None:
            return super().forward(batch, backend, images)
        if images is None:
            images = self.image_encoder.image_embeds(batch.mm)
        batch.mm.bidirectional = self.config.bidirectional_images
        return super().forward(batch, backend, images)
