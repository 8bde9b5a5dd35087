"""Prompt text + images -> token ids with expanded image placeholders and the images' patches.

The image processor is transformers' own (`Gemma4ImageProcessorPil`, configured from the checkpoint's
`preprocessor_config.json`): it resizes each image to fit its soft-token budget, rescales and patchifies. Its
torchvision twin (`Gemma4ImageProcessor`), and with it `Gemma4Processor`, cannot be imported where torchvision
is missing or does not load next to the local torch build (the CPU test machines), so the placeholder
expansion is done here as `Gemma4Processor.replace_image_token` does it: each `<|image|>` of the text becomes
`<|image>` + one `<|image|>` per soft token + `<image|>`.

`max_soft_tokens` (70, 140, 280, 560 or 1120; the checkpoint's default otherwise) sets a request's budget per
image and per video frame through `mm_processor_kwargs` (as transformers passes it to both processors);
`num_frames` the frames sampled per video. Videos (`<|video|>` in the text) are expanded as `multimodal/video.py`
says; each sampled frame becomes one item, in text order with the images.

A request's images are preprocessed (and hashed) concurrently, one image per worker thread: PIL's resize,
numpy's arithmetic and sha256 release the GIL, and one thread builds every request of the server (the
tokenizer is not shared between threads), so 6 images of 480x480 took ~120-220 ms one after another on two
cores, which bounded a server to a few image requests per second whatever the GPU did.
"""

from __future__ import annotations

import dataclasses
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from srt.multimodal.inputs import ImageItem, MultimodalInputs
from srt.multimodal.video import Video, VideoSettings, frames_prompt, preprocess_video

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
KNOWN_KWARGS = ("max_soft_tokens", "num_frames")
MAX_IMAGE_WORKERS = 8


class ImagePromptProcessor:
    """Expands a prompt's image placeholders and preprocesses its images (the tokenizer process's side)."""

    def __init__(
        self, tokenizer, image_token_id: int, model_path: str | None = None, video_token_id: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        self.video_token_id = video_token_id
        self.video_token = None if video_token_id is None else tokenizer.convert_ids_to_tokens(video_token_id)
        self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
        config_dir = Path(model_path) if model_path else None
        if config_dir is not None and (config_dir / "preprocessor_config.json").is_file():
            self.image_processor = Gemma4ImageProcessorPil.from_pretrained(str(config_dir))
        else:  # a dummy preset: the published defaults
            self.image_processor = Gemma4ImageProcessorPil()
        self.video_settings = VideoSettings.from_checkpoint(config_dir)
        self.workers = ThreadPoolExecutor(min(MAX_IMAGE_WORKERS, os.cpu_count() or 1), thread_name_prefix="srt-image")

    def process(
        self,
        text: str,
        images: list[Image.Image],
        add_special_tokens: bool = True,
        mm_processor_kwargs: dict | None = None,
        videos: list[Video] | None = None,
    ) -> tuple[list[int], MultimodalInputs]:
        """Token ids of `text` with each `<|image|>` and `<|video|>` expanded, and the images and video frames;
        ValueError naming the problem."""
        videos = videos or []
        kwargs = dict(mm_processor_kwargs or {})
        unknown = sorted(set(kwargs) - set(KNOWN_KWARGS))
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown keys {unknown}; known: {list(KNOWN_KWARGS)}")
        if "max_soft_tokens" in kwargs and kwargs["max_soft_tokens"] not in SUPPORTED_SOFT_TOKENS:
            raise ValueError(f"mm_processor_kwargs.max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}")
        num_frames = kwargs.pop("num_frames", None)
        if num_frames is not None and (not isinstance(num_frames, int) or num_frames < 1):
            raise ValueError("mm_processor_kwargs.num_frames must be a positive integer")
        if videos and self.video_token is None:
            raise ValueError("video_data: this model has no video token")
        tokens = [self.image_token] + ([self.video_token] if self.video_token else [])
        pieces = re.split("(" + "|".join(re.escape(t) for t in tokens) + ")", text)
        marks = pieces[1::2]
        for kind, token, sent in (("image", self.image_token, images), ("video", self.video_token, videos)):
            wanted = marks.count(token) if token else 0
            if wanted != len(sent):
                raise ValueError(
                    f"the prompt has {wanted} {kind} placeholders ({token}) but {len(sent)} {kind}s were sent"
                )
        if not images and not videos:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens), MultimodalInputs()
        frames: list[ImageItem] = []  # images and video frames in text order, offsets not yet known
        image_frames = iter(self.workers.map(lambda image: self._image(image, kwargs), images))
        video_parts = iter(videos)
        expanded = pieces[0]
        for mark, piece in zip(marks, pieces[2::2], strict=True):
            if mark == self.image_token:
                frame = next(image_frames)
                frames.append(frame)
                expanded += self.boi_token + self.image_token * frame.num_tokens + self.eoi_token
            else:
                sampled, stamps = preprocess_video(
                    next(video_parts), self.video_settings, num_frames, kwargs.get("max_soft_tokens")
                )
                frames += [ImageItem.build(f.patches, f.positions, f.num_tokens, offset=0) for f in sampled]
                expanded += frames_prompt(
                    stamps, sampled[0].num_tokens, self.boi_token, self.video_token, self.eoi_token
                )
            expanded += piece
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        placeholder_ids = {self.image_token_id} | ({self.video_token_id} if self.video_token else set())
        offsets = _placeholder_runs(ids, placeholder_ids)
        if [length for _, length in offsets] != [frame.num_tokens for frame in frames]:
            raise ValueError("the image placeholders did not survive tokenization as expected")
        items = [dataclasses.replace(frame, offset=offset) for (offset, _), frame in zip(offsets, frames, strict=True)]
        return ids, MultimodalInputs(items)

    def _image(self, image: Image.Image, kwargs: dict) -> ImageItem:
        """One image's real patches, their positions, its soft-token count (transformers' processor, which
        treats each image of a batch on its own) and hash; its offset is set once the prompt is tokenized."""
        out = self.image_processor(images=[image], return_tensors="np", **kwargs)
        positions = out["image_position_ids"][0]
        real = (positions >= 0).all(axis=-1)  # the processor pads to the budget with position -1
        count = int(out["num_soft_tokens_per_image"][0])
        return ImageItem.build(out["pixel_values"][0][real], positions[real], count, offset=0)


def _placeholder_runs(ids: list[int], token_ids: set[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of placeholders (any of `token_ids`, a run of one kind) in `ids`."""
    marks = np.flatnonzero(np.isin(np.asarray(ids), list(token_ids)))
    runs: list[tuple[int, int]] = []
    for position in marks.tolist():
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs
