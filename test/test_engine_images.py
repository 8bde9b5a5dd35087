"""`Engine.generate(prompt, image_data=..., video_data=...)`: PIL images, bare base64 strings, data: URLs and local
paths give exactly the tokens of the same prompt and images run by a Scheduler in this process, alone and in a
batch beside a text-only prompt; so do videos given as frames or as an animated GIF; a bad image raises
ValueError naming it, and the engine keeps working."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
from mm_fixtures import IMAGE, VIDEO, processor_of, seeded_image
from PIL import Image, ImageSequence
from serving_fixtures import CHILD_ENV, MODEL_ARGS
from torch_threads import one_torch_thread
from transformers import AutoTokenizer

from srt import Engine
from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.multimodal.video import Video
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.tools.make_checkpoint import make_checkpoint

NEW_TOKENS = 5
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SOFT_TOKENS = {"max_soft_tokens": 70}


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint("tiny-gemma-4-E4B-it", tmp_path_factory.mktemp("mm-engine"), multimodal=True)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-media")
    (folder / "photo.png").write_bytes(png_bytes(seeded_image(64, 96, seed=33)))
    return folder


@pytest.fixture(scope="module")
def engine(model, media):
    saved = {key: os.environ.get(key) for key in CHILD_ENV}
    os.environ.update(CHILD_ENV)  # the scheduler child runs one torch thread, as the reference below
    try:
        with Engine(
            model_path=str(model), log_level="warning", allowed_local_media_path=str(media), **MODEL_ARGS
        ) as engine:
            yield engine
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def in_process(model, prompts: list[tuple], kwargs: dict = SOFT_TOKENS) -> list[list[int]]:
    """Greedy tokens of each (prompt, images[, videos]) from a Scheduler in this process, all in one batch."""
    processor = processor_of(model)
    requests = []
    for i, (text, images, *videos) in enumerate(prompts):
        ids, mm = processor.process(text, images, mm_processor_kwargs=kwargs, videos=videos[0] if videos else None)
        params = SamplingParams(**GREEDY)
        requests.append(TokenizedGenerateReq(f"r{i}", ids, params, mm_inputs=mm if mm.items else None))
    args = ServerArgs(model_path=str(model), **MODEL_ARGS)
    with one_torch_thread():
        results = run_to_completion(Scheduler(args, ModelRunner(args)), requests)
    return [results[r.rid].output_ids for r in requests]


def test_pil_images_base64_data_urls_and_paths(engine, model, media) -> None:
    images = [seeded_image(96, 64, seed=30), seeded_image(80, 80, seed=31), seeded_image(64, 112, seed=32)]
    photo = media / "photo.png"
    text = f"First {IMAGE}, second {IMAGE}, third {IMAGE}, fourth {IMAGE}."
    sources = [
        images[0],  # a PIL image, handed over as it is
        base64.b64encode(png_bytes(images[1])).decode(),  # bare base64
        "data:image/png;base64," + base64.b64encode(png_bytes(images[2])).decode(),
        str(photo),  # a local path under allowed_local_media_path
    ]
    ordered = [*images, Image.open(photo).convert("RGB")]
    swapped = [ordered[0], ordered[2], ordered[1], ordered[3]]
    expected, other = in_process(model, [(text, ordered), (text, swapped)])
    assert expected != other  # the tokens depend on the images and their order: the comparison below can fail
    out = engine.generate(text, GREEDY, image_data=sources, mm_processor_kwargs=SOFT_TOKENS)
    assert out["output_ids"] == expected
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    ids, _ = processor_of(model).process(text, [*images, Image.open(photo)], mm_processor_kwargs=SOFT_TOKENS)
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_batch_with_images_beside_a_text_only_prompt(engine, model) -> None:
    one, two = seeded_image(96, 64, seed=40), seeded_image(64, 64, seed=41)
    prompts = [
        (f"Describe {IMAGE} briefly.", [one]),
        ("Only text here, thanks.", []),
        (f"{IMAGE} vs {IMAGE}", [one, two]),
    ]
    expected = in_process(model, prompts)
    image_data = [one, None, [base64.b64encode(png_bytes(one)).decode(), two]]
    out = engine.generate([p for p, _ in prompts], GREEDY, image_data=image_data, mm_processor_kwargs=SOFT_TOKENS)
    assert [r["output_ids"] for r in out] == expected


def test_bad_image_raises_value_error_and_the_engine_keeps_working(engine, model) -> None:
    with pytest.raises(ValueError, match=r"image_data\[0\]: the image cannot be decoded"):
        engine.generate(f"Look {IMAGE}", GREEDY, image_data=[base64.b64encode(b"not a picture").decode()])
    with pytest.raises(ValueError, match="2 images were sent"):
        engine.generate(f"Look {IMAGE}", GREEDY, image_data=[seeded_image(64, 64, 1), seeded_image(64, 64, 2)])
    image = seeded_image(64, 80, seed=42)
    [expected] = in_process(model, [(f"Look {IMAGE}", [image])])
    out = engine.generate(f"Look {IMAGE}", GREEDY, image_data=[image], mm_processor_kwargs=SOFT_TOKENS)
    assert out["output_ids"] == expected


def gif_bytes(frames: list[Image.Image], duration_ms: int) -> bytes:
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=duration_ms, loop=0)
    return buffer.getvalue()


def test_videos_as_frames_and_as_an_animated_gif(engine, model) -> None:
    kwargs = {**SOFT_TOKENS, "num_frames": 4}
    frames = [seeded_image(64, 48, seed=50 + i) for i in range(8)]
    image = seeded_image(64, 64, seed=60)
    text = f"Clip {VIDEO} then {IMAGE}?"
    as_frames = Video(np.stack([np.asarray(f) for f in frames]), fps=4.0)
    gif = gif_bytes(frames, duration_ms=500)  # 2 fps; GIF's palette changes the pixels
    decoded = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(io.BytesIO(gif)))]
    as_gif = Video(np.stack(decoded), fps=2.0)
    expected = in_process(model, [(text, [image], [as_frames]), (text, [image], [as_gif])], kwargs)
    assert expected[0] != expected[1]  # the frames (and timestamps) matter
    out = engine.generate(
        text, GREEDY, image_data=[image], video_data=[{"frames": frames, "fps": 4.0}], mm_processor_kwargs=kwargs
    )
    assert out["output_ids"] == expected[0]
    gif_url = "data:image/gif;base64," + base64.b64encode(gif).decode()
    out = engine.generate(text, GREEDY, image_data=[image], video_data=gif_url, mm_processor_kwargs=kwargs)
    assert out["output_ids"] == expected[1]
    with pytest.raises(ValueError, match=r"video_data\[0\]: the video cannot be decoded"):
        engine.generate(text, GREEDY, image_data=[image], video_data=["data:video/mp4;base64,AAAA"])
    with pytest.raises(ValueError, match="fewer than the 32 to sample"):  # transformers' default: 32 frames
        engine.generate(text, GREEDY, image_data=[image], video_data=[{"frames": frames}])
