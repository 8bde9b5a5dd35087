"""Prompt text + images -> token ids with expanded image placeholders and the images' patches.

The image processor is transformers' own (`Gemma4ImageProcessorPil`, configured from the checkpoint's
`preprocessor_config.json`): it resizes each image to fit its soft-token budget, rescales and patchifies. Its
torchvision twin (`Gemma4ImageProcessor`), and with it `Gemma4Processor`, cannot be imported where torchvision
is missing or does not load next to the local torch build (the CPU test machines), so the placeholder
expansion is done here as `Gemma4Processor.replace_image_token` does it: each `<|image|>` of the text becomes
`<|image>` + one `<|image|>` per soft token + `<image|>`.

`max_soft_tokens` (70, 140, 280, 560 or 1120; the checkpoint's default otherwise) sets a request's budget per
image through `mm_processor_kwargs`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from srt.multimodal.inputs import ImageItem, MultimodalInputs

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
KNOWN_KWARGS = ("max_soft_tokens",)


class ImagePromptProcessor:
    """Expands a prompt's image placeholders and preprocesses its images (the tokenizer process's side)."""

    def __init__(self, tokenizer, image_token_id: int, model_path: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
        config_dir = Path(model_path) if model_path else None
        if config_dir is not None and (config_dir / "preprocessor_config.json").is_file():
            self.image_processor = Gemma4ImageProcessorPil.from_pretrained(str(config_dir))
        else:  # a dummy preset: the published defaults
            self.image_processor = Gemma4ImageProcessorPil()

    def process(
        self,
        text: str,
        images: list[Image.Image],
        add_special_tokens: bool = True,
        mm_processor_kwargs: dict | None = None,
    ) -> tuple[list[int], MultimodalInputs]:
        """Token ids of `text` with each `<|image|>` expanded, and the images; ValueError naming the problem."""
        kwargs = dict(mm_processor_kwargs or {})
        unknown = sorted(set(kwargs) - set(KNOWN_KWARGS))
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown keys {unknown}; known: {list(KNOWN_KWARGS)}")
        if "max_soft_tokens" in kwargs and kwargs["max_soft_tokens"] not in SUPPORTED_SOFT_TOKENS:
            raise ValueError(f"mm_processor_kwargs.max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}")
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} image placeholders ({self.image_token}) but {len(images)} "
                "images were sent"
            )
        if not images:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens), MultimodalInputs()
        out = self.image_processor(images=images, return_tensors="np", **kwargs)
        counts = [int(n) for n in out["num_soft_tokens_per_image"]]
        expanded = pieces[0]
        for count, piece in zip(counts, pieces[1:], strict=True):
            expanded += self.boi_token + self.image_token * count + self.eoi_token + piece
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        offsets = _placeholder_runs(ids, self.image_token_id)
        if [length for _, length in offsets] != counts:
            raise ValueError("the image placeholders did not survive tokenization as expected")
        items = []
        for (offset, count), patches, positions in zip(
            offsets, out["pixel_values"], out["image_position_ids"], strict=True
        ):
            real = (positions >= 0).all(axis=-1)  # the processor pads to the budget with position -1
            items.append(ImageItem.build(patches[real], positions[real], count, offset))
        return ids, MultimodalInputs(items)


def _placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id` in `ids`."""
    marks = np.flatnonzero(np.asarray(ids) == token_id)
    runs: list[tuple[int, int]] = []
    for position in marks.tolist():
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs
