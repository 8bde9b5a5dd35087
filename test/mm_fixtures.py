"""Shared pieces of the image-input tests: tiny multimodal checkpoints, seeded images, srt's processor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoTokenizer

from srt.configs.model_config import ModelConfig
from srt.multimodal.processor import ImagePromptProcessor

IMAGE = "<|image|>"
VIDEO = "<|video|>"


def seeded_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth random colours (a blurred noise field), so resizing does not average everything to grey."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BILINEAR)


def processor_of(path: Path) -> ImagePromptProcessor:
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = ModelConfig.from_pretrained(path)
    return ImagePromptProcessor(tokenizer, config.image_token_id, str(path), config.video_token_id)
