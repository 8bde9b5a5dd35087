"""Where a prefill chunk may end when image tokens attend to each other both ways.

On 26B-A4B and 31B (`use_bidirectional_attention: vision`) every token of an image sees every other token of
it in sliding layers, later ones included. A chunk that ended inside an image would compute its first part's
KV without the rest of the image, and no later chunk can mend that. So on those checkpoints a chunk never ends
inside an image: it stops before the image, or, when the image starts the chunk, takes the whole image even
past the chunk budget (an image is at most 1,120 tokens):

    budget:          |-------- num --------|
    prompt:   text text <|image> [img img img img img] <image|> text
    chunk:    text text <|image>|                          stops before the image
    next:                       [img img img img img] <image|>  the whole image first

On E2B and E4B attention is causal everywhere; a chunk may end anywhere and the encoder's cache hands the
next chunk the rest of the image's embeddings.
"""

from __future__ import annotations

from srt.multimodal.inputs import MultimodalInputs


def chunk_without_split_image(mm: MultimodalInputs, start: int, num: int) -> int:
    """How many of `num` tokens from prompt position `start` to compute so that no image is split."""
    end = start + num
    image = mm.image_containing(end - 1)
    if image is None or image.end <= end:
        return num
    if image.offset > start:
        return image.offset - start
    return image.end - start
