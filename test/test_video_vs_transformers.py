"""Prompts with a video: srt's greedy tokens and log-probabilities against transformers'
Gemma4ForConditionalGeneration (float32) on tiny multimodal checkpoints of all four variants.

transformers gets the sampled frames' patches as `pixel_values_videos` (padded to the patch budget with position
-1, as its video processor pads them) and `mm_token_type_ids` 2 on the video placeholders; srt gets the video
through `ImagePromptProcessor` and runs the request through its scheduler, beside an image request and a
text-only one, and once with prefill chunks that end inside frames. The frame sampling is checked against
transformers' own `BaseVideoProcessor.sample_frames`; the resize against `Gemma4VideoProcessor` where
torchvision can be imported (not on the CPU machines).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mm_fixtures import IMAGE, VIDEO, processor_of, seeded_image
from test_vision_vs_transformers import (
    LOGPROB_TOL,
    NEW_TOKENS,
    SOFT_TOKENS,
    VARIANTS,
    ReferenceModel,
    image_request,
    make_scheduler,
    reference_logprobs,
)
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata

from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.multimodal.video import Video, VideoSettings, preprocess_video, sample_indices
from srt.sampling.sampling_params import SamplingParams
from srt.tools.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

VIDEO_KWARGS = {**SOFT_TOKENS, "num_frames": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {v: make_checkpoint(f"tiny-{v}", tmp_path_factory.mktemp(v), multimodal=True) for v in VARIANTS}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, ReferenceModel]:
    return {
        name: ReferenceModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        for name, path in checkpoints.items()
    }


def seeded_video(num_frames: int, width: int, height: int, seed: int, fps: float | None = 2.0) -> Video:
    frames = np.stack([np.asarray(seeded_image(width, height, seed=seed * 100 + i)) for i in range(num_frames)])
    return Video(frames, fps)


def video_request(path: Path, rid: str, text: str, videos: list[Video]) -> TokenizedGenerateReq:
    ids, mm = processor_of(path).process(text, [], mm_processor_kwargs=VIDEO_KWARGS, videos=videos)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    start = mm.items[0].offset
    return TokenizedGenerateReq(
        rid, ids, params, return_logprob=True, logprob_start_len=start, top_logprobs_num=1, mm_inputs=mm
    )


def reference_video_inputs(model: ReferenceModel, request: TokenizedGenerateReq, ids: list[int]) -> dict:
    """transformers' inputs: the frames padded to the budget, as its video processor hands them over."""
    frames = request.mm_inputs.items
    max_patches = SOFT_TOKENS["max_soft_tokens"] * model.config.vision_config.pooling_kernel_size**2
    pixels = torch.zeros(1, len(frames), max_patches, frames[0].patches.shape[1])
    positions = torch.full((1, len(frames), max_patches, 2), -1, dtype=torch.long)
    for f, frame in enumerate(frames):
        pixels[0, f, : frame.num_patches] = torch.from_numpy(frame.patches)
        positions[0, f, : frame.num_patches] = torch.from_numpy(frame.positions)
    input_ids = torch.tensor([ids])
    types = (input_ids == model.config.video_token_id).long() * 2
    return {
        "input_ids": input_ids,
        "pixel_values_videos": pixels,
        "video_position_ids": positions,
        "mm_token_type_ids": types,
    }


def check_video_against_reference(model: ReferenceModel, request: TokenizedGenerateReq, result) -> None:
    inputs = reference_video_inputs(model, request, request.input_ids)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    assert result.output_ids == out[0, len(request.input_ids) :].tolist()
    inputs = reference_video_inputs(model, request, request.input_ids + result.output_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**inputs).logits[0].double(), dim=-1)
    for offset, lp in enumerate(result.input_logprobs):
        position = request.logprob_start_len + offset
        assert lp.logprob == pytest.approx(float(logprobs[position - 1, lp.token_id]), abs=LOGPROB_TOL)
    for step, lp in enumerate(result.output_logprobs):
        row = len(request.input_ids) - 1 + step
        assert lp.logprob == pytest.approx(float(logprobs[row, lp.token_id]), abs=LOGPROB_TOL)


def test_frame_sampling_is_transformers() -> None:
    for total, wanted in ((10, 4), (32, 32), (33, 32), (100, 7), (61, 32)):
        metadata = VideoMetadata(total_num_frames=total, fps=24.0)
        expected = BaseVideoProcessor.sample_frames(SimpleNamespace(num_frames=wanted, fps=None), metadata)
        assert sample_indices(total, wanted).tolist() == expected.tolist()
    with pytest.raises(ValueError, match="fewer than the 32 to sample"):
        sample_indices(20, 32)


def test_prompt_has_a_timestamp_and_placeholders_per_frame(checkpoints) -> None:
    """replace_video_token's layout: "mm:ss <|image>" + soft tokens + "<image|>" per sampled frame, spaced."""
    path = checkpoints["gemma-4-E4B-it"]
    video = seeded_video(10, 64, 48, seed=1, fps=2.0)  # frames 0, 2, 5, 7 of 10: 0 s, 1 s, 2.5 s, 3.5 s
    processor = processor_of(path)
    ids, mm = processor.process(f"A {VIDEO} B", [], mm_processor_kwargs=VIDEO_KWARGS, videos=[video])
    count = mm.items[0].num_tokens
    frame = "<|image>" + VIDEO * count + "<image|>"
    expected = f"<bos>A {' '.join(f'{t} {frame}' for t in ('00:00', '00:01', '00:02', '00:03'))} B"
    assert processor.tokenizer.decode(ids) == expected
    assert len(mm.items) == 4 and [item.offset for item in mm.items] == [
        i for i in range(len(ids)) if ids[i] == processor.video_token_id and ids[i - 1] != ids[i]
    ]
    frames, stamps = preprocess_video(seeded_video(3, 64, 48, seed=2, fps=None), VideoSettings(num_frames=3))
    assert stamps == ["00:00"] * 3  # unknown frame rate: 24 fps, as transformers assumes
    with pytest.raises(ValueError, match="1 video placeholders"):
        processor.process(f"A {VIDEO} B", [], videos=[video, video])


def test_resize_and_patches_match_the_video_processor() -> None:
    """Where torchvision loads (GPU machines), transformers' own video processor gives the same patches."""
    pytest.importorskip("torchvision")
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    video = seeded_video(10, 80, 56, seed=3)
    out = Gemma4VideoProcessor()(videos=[video.frames], num_frames=4, do_sample_frames=True, return_tensors="pt")
    frames, _ = preprocess_video(video, VideoSettings(num_frames=4))
    for f, frame in enumerate(frames):
        real = (out["video_position_ids"][0, f] >= 0).all(-1)
        assert np.array_equal(out["video_position_ids"][0, f][real].numpy(), frame.positions)
        np.testing.assert_allclose(out["pixel_values_videos"][0, f][real].numpy(), frame.patches, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_video_beside_image_and_text_only_requests(checkpoints, references, variant: str) -> None:
    path, model = checkpoints[variant], references[variant]
    video_req = video_request(path, "video", f"Watch {VIDEO} and tell", [seeded_video(10, 64, 48, seed=4)])
    image = seeded_image(80, 64, seed=5)
    image_req = image_request(path, "image", f"Look at {IMAGE} now", [image])
    text_req = image_request(path, "text", "Only words in this one.", [])
    scheduler = make_scheduler(path)
    results = run_to_completion(scheduler, [video_req, image_req, text_req])
    check_video_against_reference(model, video_req, results["video"])
    assert_greedy_by_forward(model, path, image_req, results["image"], [image])
    assert_greedy_by_forward(model, path, text_req, results["text"], [])
    scheduler.check_integrity()


def assert_greedy_by_forward(model, path: Path, request: TokenizedGenerateReq, result, images: list) -> None:
    """Each srt token is the argmax of transformers' forward over the prompt and srt's earlier tokens (greedy
    decoding without a KV cache). Not `generate` here: on tiny 26B-A4B and 31B (sliding window 16), transformers'
    `generate` for this image prompt (4 text tokens after the image) disagrees with its own forward from the second
    token on, cached or not, while srt agrees with the forward."""
    outputs = result.output_ids
    logprobs = reference_logprobs(model, path, request.input_ids + outputs, images)
    rows = range(len(request.input_ids) - 1, len(request.input_ids) - 1 + len(outputs))
    assert [int(logprobs[row].argmax()) for row in rows] == outputs


@pytest.mark.parametrize("variant", ["gemma-4-E2B-it", "gemma-4-26B-A4B-it"])
def test_chunk_boundaries_inside_frames(checkpoints, references, variant: str) -> None:
    """Chunks of 25 tokens against frames of 63 soft tokens: E2B splits frames (causal), 26B-A4B moves each
    boundary before a frame and takes the frame whole (bidirectional within a frame)."""
    path, model = checkpoints[variant], references[variant]
    request = video_request(path, "chunked", f"Clip: {VIDEO} ends", [seeded_video(12, 48, 64, seed=6)])
    scheduler = make_scheduler(path, chunked_prefill_size=25)
    result = run_to_completion(scheduler, [request])["chunked"]
    check_video_against_reference(model, request, result)
    scheduler.check_integrity()
