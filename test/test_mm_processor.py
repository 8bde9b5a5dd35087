"""srt's prompt processor preprocesses a request's images one per worker thread: the items must be what
transformers' image processor gives for the whole batch at once (its real patches, positions and soft-token
counts, in prompt order), with offsets at each image's placeholders."""

from __future__ import annotations

import numpy as np
from mm_fixtures import IMAGE, processor_of, seeded_image

from srt.tools.make_checkpoint import make_checkpoint

SIZES = [(480, 480), (320, 200), (96, 640)]


def test_images_preprocessed_apart_equal_one_batched_call(tmp_path) -> None:
    path = make_checkpoint("tiny-gemma-4-E2B-it", tmp_path, multimodal=True)
    processor = processor_of(path)
    images = [seeded_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    ids, mm = processor.process(f"One {IMAGE} two {IMAGE} three {IMAGE}.", images)
    batched = processor.image_processor(images=images, return_tensors="np")
    assert len(mm.items) == len(images)
    for item, patches, positions, count in zip(
        mm.items, batched["pixel_values"], batched["image_position_ids"], batched["num_soft_tokens_per_image"]
    ):
        real = (positions >= 0).all(axis=-1)
        np.testing.assert_array_equal(item.patches, patches[real])
        np.testing.assert_array_equal(item.positions, positions[real])
        assert item.num_tokens == count
        assert set(ids[item.offset : item.end]) == {processor.image_token_id}
        assert ids[item.offset - 1] != processor.image_token_id and ids[item.end] != processor.image_token_id
    assert len({item.content_hash for item in mm.items}) == len(images)
