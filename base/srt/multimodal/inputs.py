"""What a request's images are once preprocessed, and which of their tokens a forward computes.

The tokenizer process turns each image into an `ImageItem`: its real patches (the image processor pads every
image to its patch budget; the padding is dropped here, so it is neither sent nor encoded), their (x, y)
positions, how many soft tokens it becomes, where those start in the prompt, and a hash of its pixels. The
prompt holds `<|image>` + soft-token placeholders + `<image|>` per image:

    prompt:   ... <|image> [img][img] ... [img] <image|> ...
                           ^ offset      num_tokens placeholders, row i <- soft token i of the image

Prefix-cache keys replace each image's placeholders by a value derived from its hash (`cache_key`), so two
prompts with the same placeholder ids but different images never share KV, and the same image does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class ImageItem:
    """One preprocessed image (or one video frame) of a request."""

    patches: np.ndarray  # [num_patches, 3 * patch_size^2] float32 in [0, 1], no padding
    positions: np.ndarray  # [num_patches, 2] int64 (x, y) of each patch
    num_tokens: int  # soft tokens it becomes (num_patches / pooling_kernel_size^2)
    offset: int  # prompt position of its first soft token
    content_hash: int  # 63-bit hash of its patches and positions

    @classmethod
    def build(cls, patches: np.ndarray, positions: np.ndarray, num_tokens: int, offset: int) -> ImageItem:
        patches = np.ascontiguousarray(patches, dtype=np.float32)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        digest = hashlib.sha256(patches.tobytes())
        digest.update(positions.tobytes())
        content_hash = int.from_bytes(digest.digest()[:8], "little") >> 1
        return cls(patches, positions, num_tokens, offset, content_hash)

    @property
    def num_patches(self) -> int:
        return int(self.patches.shape[0])

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def cache_key_token(self) -> int:
        """The prefix-cache key of each of its placeholders: negative, so no real token id can equal it."""
        return -1 - self.content_hash


@dataclass
class MultimodalInputs:
    """A request's images in prompt order (their placeholder spans do not overlap)."""

    items: list[ImageItem] = field(default_factory=list)

    def cache_key(self, ids: list[int], start: int = 0) -> list[int]:
        """`ids` (the prompt's tokens from position `start`) with every image placeholder replaced by its
        image's key token."""
        key = list(ids)
        stop = start + len(ids)
        for item in self.items:
            lo, hi = max(item.offset, start), min(item.end, stop)
            if lo < hi:
                key[lo - start : hi - start] = [item.cache_key_token] * (hi - lo)
        return key

    def spans_in(self, start: int, stop: int) -> list[tuple[ImageItem, int, int]]:
        """(image, first soft token, count) of each image with placeholders among prompt positions
        [start, stop)."""
        found = []
        for item in self.items:
            lo, hi = max(item.offset, start), min(item.end, stop)
            if lo < hi:
                found.append((item, lo - item.offset, hi - lo))
        return found

    def image_containing(self, position: int) -> ImageItem | None:
        """The image whose placeholders include prompt `position`, if any."""
        return next((item for item in self.items if item.offset <= position < item.end), None)


@dataclass(frozen=True)
class ImageRows:
    """Rows of a forward batch that take soft tokens first .. first + count - 1 of `item`."""

    item: ImageItem
    batch_row: int
    first: int
    count: int


@dataclass
class MultimodalBatch:
    """The image rows of one forward batch, and per request the prompt spans of its images (for the attention
    mask of checkpoints whose image tokens attend bidirectionally)."""

    rows: list[ImageRows]
    request_spans: list[list[tuple[int, int]]]  # per request: (first, end) prompt positions of each image
    # image tokens attend to each other both ways in sliding layers (set by the model from its config)
    bidirectional: bool = False

    @property
    def items(self) -> list[ImageItem]:
        """The images the batch needs, each once, in order of first use."""
        seen: dict[int, ImageItem] = {}
        for rows in self.rows:
            seen.setdefault(rows.item.content_hash, rows.item)
        return list(seen.values())


def multimodal_batch(requests: list[tuple[MultimodalInputs | None, int, int]]) -> MultimodalBatch | None:
    """The image rows of a batch whose request i computes prompt positions [start_i, stop_i) (given in batch
    order as (inputs, start, stop)); None when no request computes any image token."""
    rows, spans, batch_row, any_image = [], [], 0, False
    for inputs, start, stop in requests:
        if inputs is None:
            spans.append([])
        else:
            spans.append([(item.offset, item.end) for item in inputs.items])
            for item, first, count in inputs.spans_in(start, stop):
                rows.append(ImageRows(item, batch_row + item.offset + first - start, first, count))
                any_image = True
        batch_row += stop - start
    return MultimodalBatch(rows, spans) if any_image else None


@dataclass(frozen=True)
class ImageEmbeds:
    """Rows of a forward batch that hold image soft tokens, and their embeddings (text hidden size)."""

    rows: torch.Tensor  # [image rows] int64 batch rows
    embeddings: torch.Tensor  # [image rows, hidden]
