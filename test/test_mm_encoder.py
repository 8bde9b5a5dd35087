"""The batched image encoder: how many vision-tower and embedder calls a set of images costs, counted with
forward hooks on the real modules of a tiny multimodal checkpoint; and that batching changes no value."""

from __future__ import annotations

import pytest
import torch
from mm_fixtures import IMAGE, processor_of, seeded_image

from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import load_model
from srt.multimodal.encoder import ImageEncoder, activation_bytes
from srt.tools.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_checkpoint("tiny-gemma-4-E2B-it", tmp_path_factory.mktemp("mm-e2b"), multimodal=True)
    model = load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.float32, torch.device("cpu"))
    calls = {"tower": 0, "embedder": 0}
    model.vision_tower.register_forward_hook(lambda *_: calls.__setitem__("tower", calls["tower"] + 1))
    model.embed_vision.register_forward_hook(lambda *_: calls.__setitem__("embedder", calls["embedder"] + 1))
    return path, model, calls


def items_of(path, sizes: list[tuple[int, int]], seed: int = 0):
    images = [seeded_image(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    text = " ".join([IMAGE] * len(images))
    _, mm = processor_of(path).process(text, images, mm_processor_kwargs={"max_soft_tokens": 70})
    return mm.items


def encoder(model, budget: int = 1 << 40, batched: bool = True, cache_tokens: int = 1 << 20) -> ImageEncoder:
    return ImageEncoder(model.vision_tower, model.embed_vision, budget, cache_tokens, batched)


def counted(calls: dict, run) -> tuple[dict, dict]:
    calls.update(tower=0, embedder=0)
    out = run()
    return dict(calls), out


def test_six_same_size_images_one_tower_and_one_embedder_call(setup) -> None:
    path, model, calls = setup
    items = items_of(path, [(96, 96)] * 6)
    assert len({item.content_hash for item in items}) == 6
    used, batched = counted(calls, lambda: encoder(model).encode(items))
    assert used == {"tower": 1, "embedder": 1}
    used, one_by_one = counted(calls, lambda: encoder(model, batched=False).encode(items))
    assert used == {"tower": 6, "embedder": 6}
    for item in items:  # batching changes no value beyond float32 rounding
        torch.testing.assert_close(batched[item.content_hash], one_by_one[item.content_hash], atol=1e-5, rtol=1e-5)


def test_two_sizes_two_tower_calls(setup) -> None:
    path, model, calls = setup
    items = items_of(path, [(96, 96), (64, 128), (96, 96), (64, 128)])
    assert len({item.num_patches for item in items}) == 2
    used, _ = counted(calls, lambda: encoder(model).encode(items))
    assert used == {"tower": 2, "embedder": 1}


def test_a_small_budget_splits_a_bucket(setup) -> None:
    path, model, calls = setup
    items = items_of(path, [(96, 96)] * 5)
    per_image = activation_bytes(model.vision_tower, items[0].num_patches, torch.float32)
    used, _ = counted(calls, lambda: encoder(model, budget=2 * per_image).encode(items))
    assert used == {"tower": 3, "embedder": 1}  # 2 + 2 + 1 images


def test_a_repeated_image_is_encoded_once(setup) -> None:
    path, model, calls = setup
    items = items_of(path, [(96, 96)] * 2, seed=7)
    again = items_of(path, [(96, 96)], seed=7)[0]  # the first image, sent again in a later request
    assert again.content_hash == items[0].content_hash
    enc = encoder(model)
    used, first = counted(calls, lambda: enc.encode([items[0], items[0], items[1]]))
    assert used == {"tower": 1, "embedder": 1} and enc.images_encoded == 2
    used, second = counted(calls, lambda: enc.encode([again]))
    assert used == {"tower": 0, "embedder": 0} and enc.images_encoded == 2
    assert torch.equal(second[again.content_hash], first[again.content_hash])
    enc.check_integrity()


def test_the_cache_evicts_least_recent_images_beyond_its_size(setup) -> None:
    path, model, calls = setup
    items = items_of(path, [(96, 96)] * 3, seed=30)
    enc = encoder(model, cache_tokens=2 * items[0].num_tokens)
    for item in items:
        enc.encode([item])
    enc.check_integrity()
    used, _ = counted(calls, lambda: enc.encode([items[0]]))  # the oldest was evicted: encoded again
    assert used == {"tower": 1, "embedder": 1}
    used, _ = counted(calls, lambda: enc.encode([items[2]]))
    assert used == {"tower": 0, "embedder": 0}
