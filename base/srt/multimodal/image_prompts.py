"""The tokenizer manager's side of image input: a request's images loaded and its prompt expanded.

Built once per server from the checkpoint's config; a text-only checkpoint refuses images with a clear error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from PIL import Image

from srt.configs.model_config import ModelConfig
from srt.multimodal.inputs import MultimodalInputs
from srt.multimodal.media import load_image, load_video
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ImagePrompts:
    """Turns (prompt text, images) into token ids and `MultimodalInputs`; the processor is built on first use."""

    def __init__(self, server_args: ServerArgs, tokenizer) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self._processor = None
        self._image_token_id: int | None = None
        self._video_token_id: int | None = None
        self._checked = False

    def _image_processor(self):
        if not self._checked:
            self._checked = True
            try:
                config = ModelConfig.from_name_or_path(self.server_args.model_path)
                self._image_token_id, self._video_token_id = config.image_token_id, config.video_token_id
            except (OSError, ValueError) as error:
                logger.warning("cannot read the model's config for image input: %s", error)
        if self._image_token_id is None:
            raise ValueError("image_data: this model takes no images (its checkpoint has no vision tower)")
        if self._processor is None:
            from srt.multimodal.processor import ImagePromptProcessor  # transformers' image processor: load late

            path = self.server_args.model_path
            self._processor = ImagePromptProcessor(
                self.tokenizer, self._image_token_id, path if Path(path).is_dir() else None, self._video_token_id
            )
        return self._processor

    def tokenize(self, single: Any, add_special_tokens: bool) -> tuple[list[int], MultimodalInputs]:
        """Token ids with expanded placeholders and the images of one request; ValueError naming the problem."""
        if single.text is None:
            raise ValueError("image_data and video_data need a text prompt with a placeholder each (not input_ids)")
        processor = self._image_processor()
        allowed, timeout = self.server_args.allowed_local_media_path, self.server_args.media_fetch_timeout

        def load(index: int, source: object) -> Image.Image:
            try:
                return load_image(source, allowed, timeout)
            except ValueError as error:
                raise ValueError(f"image_data[{index}]: {error}") from None

        # fetched and decoded on the processor's worker threads, like their preprocessing: URLs in parallel
        sources = single.image_data or []
        images = list(processor.workers.map(load, range(len(sources)), sources))
        videos = []
        for i, source in enumerate(single.video_data or []):
            try:
                videos.append(load_video(source, allowed, timeout))
            except ValueError as error:
                raise ValueError(f"video_data[{i}]: {error}") from None
        return processor.process(single.text, images, add_special_tokens, single.mm_processor_kwargs, videos)
