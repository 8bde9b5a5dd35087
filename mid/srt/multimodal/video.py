"""Video input as transformers' `Gemma4VideoProcessor` and `Gemma4Processor.replace_video_token` do it, without
torchvision (which `Gemma4VideoProcessor` imports, and which cannot be loaded on the CPU machines).

A video is its frames (uint8, [T, H, W, 3]) and its frame rate. Like transformers:

    sample         num_frames (default 32) frame indices: arange(0, T, T / num_frames).int()
    resize         every frame to the largest size of at most max_soft_tokens * 3^2 patches (default 70 soft
                   tokens per frame) with sides divisible by 48: bicubic, antialiased, on the uint8 frames
                   (torchvision's CPU path: torch's native uint8 kernel)
    rescale        x / 255 in float32
    patchify       16x16 patches, (x, y) positions, one frame = one image to the vision tower
    prompt         each <|video|> of the text becomes, per sampled frame, "mm:ss <|image>" + one <|video|> per
                   soft token + "<image|>", frames joined by spaces; mm:ss is the frame index / fps

In the model a frame is an image: the same tower and embedder, its own bidirectional block on 26B-A4B / 31B
(transformers groups each contiguous run of vision placeholders). So each frame becomes an `ImageItem`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_FPS = 24.0  # what transformers assumes when a video's frame rate is unknown


@dataclass(frozen=True)
class Video:
    """Decoded frames ([T, H, W, 3] uint8) and frames per second (None: unknown)."""

    frames: np.ndarray
    fps: float | None = None


@dataclass(frozen=True)
class VideoSettings:
    """The video processor's settings (transformers' `Gemma4VideoProcessor` defaults, or the checkpoint's)."""

    num_frames: int = 32
    max_soft_tokens: int = 70
    patch_size: int = 16
    pooling_kernel_size: int = 3

    @classmethod
    def from_checkpoint(cls, model_dir: Path | None) -> VideoSettings:
        """The `video_processor` section of `processor_config.json` (or `video_preprocessor_config.json`)."""
        found: dict = {}
        if model_dir is not None:
            for name, key in (("video_preprocessor_config.json", None), ("processor_config.json", "video_processor")):
                path = model_dir / name
                if path.is_file():
                    data = json.loads(path.read_text())
                    found = data if key is None else data.get(key) or {}
                    if found:
                        break
        known = {
            k: found[k] for k in ("num_frames", "max_soft_tokens", "patch_size", "pooling_kernel_size") if k in found
        }
        return cls(**known)


@dataclass(frozen=True)
class ProcessedFrame:
    patches: np.ndarray  # [num_patches, 3 * patch_size^2] float32
    positions: np.ndarray  # [num_patches, 2] int64 (x, y)
    num_tokens: int


def sample_indices(total_frames: int, num_frames: int) -> np.ndarray:
    """transformers' default frame sampling (`BaseVideoProcessor.sample_frames`), in the same float32 steps."""
    if num_frames > total_frames:
        raise ValueError(f"the video has {total_frames} frames, fewer than the {num_frames} to sample (num_frames)")
    return torch.arange(0, total_frames, total_frames / num_frames).int().numpy()


def timestamp(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def preprocess_video(
    video: Video, settings: VideoSettings, num_frames: int | None = None, max_soft_tokens: int | None = None
) -> tuple[list[ProcessedFrame], list[str]]:
    """The sampled frames' patches and the timestamp of each ("mm:ss")."""
    # transformers' sizing (the video processor's copy of it cannot be imported without torchvision); loaded late
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    frames = video.frames
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise ValueError(f"a video must be uint8 RGB frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    indices = sample_indices(frames.shape[0], num_frames or settings.num_frames)
    fps = video.fps or DEFAULT_FPS
    stamps = [timestamp(int(i) / fps) for i in indices]
    patch, pool = settings.patch_size, settings.pooling_kernel_size
    max_patches = (max_soft_tokens or settings.max_soft_tokens) * pool**2
    sampled = torch.from_numpy(np.ascontiguousarray(frames[indices])).permute(0, 3, 1, 2).contiguous()
    height, width = sampled.shape[-2:]
    target = get_aspect_ratio_preserving_size(height, width, patch, max_patches, pool)
    if target != (height, width):
        # torchvision's tensor resize on CPU: torch's native uint8 bicubic kernel with antialiasing
        sampled = torch.nn.functional.interpolate(
            sampled, size=list(target), mode="bicubic", antialias=True, align_corners=False
        )
    pixels = sampled.to(torch.float32) / 255.0
    t, c, h, w = pixels.shape
    ph, pw = h // patch, w // patch
    patches = pixels.reshape(t, c, ph, patch, pw, patch).permute(0, 2, 4, 3, 5, 1).reshape(t, ph * pw, -1)
    xs, ys = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
    positions = np.stack([xs, ys], axis=-1).reshape(ph * pw, 2).astype(np.int64)
    num_tokens = ph * pw // pool**2
    out = [ProcessedFrame(patches[i].numpy(), positions, num_tokens) for i in range(t)]
    return out, stamps


def frames_prompt(stamps: list[str], num_tokens: int, boi: str, video_token: str, eoi: str) -> str:
    """`Gemma4Processor.replace_video_token`: what one <|video|> of the text becomes."""
    return " ".join(f"{stamp} {boi}{video_token * num_tokens}{eoi}" for stamp in stamps)


def frame_rate_of(durations_ms: list[float]) -> float | None:
    """Frames per second from per-frame display durations (animated images), None if unknown."""
    total = sum(durations_ms)
    return len(durations_ms) * 1000.0 / total if total > 0 and math.isfinite(total) else None
