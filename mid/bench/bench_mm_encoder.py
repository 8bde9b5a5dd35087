"""Time the image encoder batched (one vision-tower call per bucket of same-size images, one embedder call) against
the per-image loop (a tower and an embedder call per image), as #24 asks, on a dummy preset's real shapes.

    python bench/bench_mm_encoder.py --model gemma-4-E2B-it --images-per-request 6 --requests 1 4 \
        --image-size 480 480 --json out.json
    python bench/bench_mm_encoder.py --model gemma-4-26B-A4B-it --images-per-request 6 --requests 1 4

Images are random 480x480 pictures (the `random-mm` workload's: 6 per request), preprocessed once by
transformers' image processor at --max-soft-tokens; each timed call encodes every image of `requests` requests
with an empty embedding cache (so nothing is served from it). Only the vision tower and the embedder are built
(the text model is not needed), with dummy weights in the model dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from srt.configs import presets
from srt.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower
from srt.multimodal.encoder import ImageEncoder
from srt.multimodal.inputs import ImageItem
from srt.multimodal.processor import ImagePromptProcessor
from srt.tools.tokenizer_builder import build_tokenizer


def build_vision(
    model: str, dtype: torch.dtype, device: torch.device
) -> tuple[Gemma4VisionTower, Gemma4VisionEmbedder]:
    config = presets.preset_config(model)
    vision = config.vision_config
    tower = Gemma4VisionTower(vision)
    embedder = Gemma4VisionEmbedder(vision.hidden_size, config.text_config.hidden_size, vision.rms_norm_eps)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (tower, embedder):
            for name, tensor in module.state_dict().items():
                if name.endswith(("_min", "_max")):
                    tensor.fill_(float("-inf") if name.endswith("_min") else float("inf"))
                elif "norm" in name or name.endswith("scale"):
                    tensor.fill_(1.0)
                else:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
    return tower.to(device, dtype).eval(), embedder.to(device, dtype).eval()


def random_items(count: int, width: int, height: int, max_soft_tokens: int) -> list[ImageItem]:
    """Preprocessed random images (transformers' image processor, through srt's prompt processor)."""
    tokenizer = build_tokenizer(presets.TINY_VOCAB_SIZE)
    image_token = presets.multimodal_token_ids(presets.TINY_VOCAB_SIZE)["image_token_id"]
    processor = ImagePromptProcessor(tokenizer, image_token)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]
    text = " ".join([processor.image_token] * count)
    _, mm = processor.process(text, images, mm_processor_kwargs={"max_soft_tokens": max_soft_tokens})
    return mm.items


def time_encoder(encoder: ImageEncoder, items: list[ImageItem], repeats: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first run warms up kernels and allocator
        encoder._cache.clear()
        encoder._cached_tokens = 0
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        encoder.encode(items)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-4-E2B-it", choices=presets.PUBLISHED)
    parser.add_argument("--images-per-request", type=int, default=6)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--image-size", type=int, nargs=2, default=[480, 480], metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--max-soft-tokens", type=int, default=280)
    parser.add_argument("--budget-mb", type=int, default=2048, help="--mm-encoder-budget-mb")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    tower, embedder = build_vision(args.model, dtype, device)
    rows = []
    for requests in args.requests:
        items = random_items(requests * args.images_per_request, *args.image_size, args.max_soft_tokens)
        result = {"model": args.model, "requests": requests, "images": len(items), "patches": items[0].num_patches}
        with torch.no_grad():
            for name, batched in (("per_image", False), ("batched", True)):
                encoder = ImageEncoder(tower, embedder, args.budget_mb << 20, 1 << 30, batched)
                result[f"{name}_ms"] = 1e3 * statistics.median(time_encoder(encoder, items, args.repeats, device))
        result["speedup"] = result["per_image_ms"] / result["batched_ms"]
        rows.append(result)
        print(
            f"{args.model} {requests} request(s) x {args.images_per_request} images "
            f"({result['patches']} patches each): "
            f"per-image {result['per_image_ms']:.2f} ms, batched {result['batched_ms']:.2f} ms, "
            f"{result['speedup']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "dtype": args.dtype, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
