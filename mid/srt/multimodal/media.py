"""Turning what users send as an image into a PIL image, or a ValueError that names the problem.

Accepted: PIL images, `data:image/...;base64,` URLs, bare base64 strings, local files (a path or a `file://`
URL), which must lie under `--allowed-local-media-path`, and http(s) URLs, fetched within
`--media-fetch-timeout` seconds and the same size caps as the other sources (the body is read in pieces and the
fetch stops at the cap, so a huge or endless answer costs no more than the cap).

Videos (`load_video`): the same kinds of sources (`data:video/...` or `data:image/...` URLs) holding an animated
image (GIF, WebP, APNG: decoded by PIL, the frame rate from the frame durations; other containers such as MP4
need PyAV, an optional dependency), a `multimodal.video.Video`, uint8 frames [T, H, W, 3], or
`{"frames": [image, ...], "fps": float}`.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image, ImageSequence

from srt.multimodal.video import Video, frame_rate_of

MAX_IMAGE_BYTES = 32 << 20  # an encoded image larger than this is refused before it is decoded
MAX_IMAGE_PIXELS = 64 << 20  # decoded width x height; PIL's own bomb check would only warn below 2x its limit
MAX_VIDEO_BYTES = 256 << 20  # an encoded video
MAX_VIDEO_PIXELS = 1 << 30  # decoded frames x width x height (1 GiB of uint8 RGB is 3 GiB)
DEFAULT_FETCH_TIMEOUT_S = 10.0
FETCH_PIECE_BYTES = 1 << 16


def load_image(
    source: object, allowed_local_path: str | None = None, fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
) -> Image.Image:
    """The RGB image `source` describes; ValueError naming what is wrong with it."""
    if isinstance(source, Image.Image):
        return _checked(source)
    if isinstance(source, bytes):
        return _decode(source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"an image must be a data: URL, a local file or base64 data, got {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header or not header.startswith("data:image/"):
            raise ValueError("an image data URL must look like data:image/<format>;base64,<data>")
        return _decode(_b64decode(payload))
    if source.startswith(("http://", "https://")):
        return _decode(fetch(source, MAX_IMAGE_BYTES, fetch_timeout, "image"))
    if source.startswith("file://") or Path(source).is_absolute():
        return _decode(_read_local(source.removeprefix("file://"), allowed_local_path))
    return _decode(_b64decode(source))


def load_video(
    source: object, allowed_local_path: str | None = None, fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
) -> Video:
    """The video `source` describes; ValueError naming what is wrong with it."""
    if isinstance(source, Video):
        return _checked_video(source)
    if isinstance(source, np.ndarray):
        return _checked_video(Video(source))
    if isinstance(source, dict):
        frames = source.get("frames")
        if not isinstance(frames, list) or not frames:
            raise ValueError('a video given as an object needs "frames": a non-empty list of images')
        images = [np.asarray(load_image(frame, allowed_local_path, fetch_timeout)) for frame in frames]
        if len({image.shape for image in images}) != 1:
            raise ValueError("the frames of a video must all have the same size")
        fps = source.get("fps")
        if fps is not None and (not isinstance(fps, (int, float)) or not 0 < fps < 1e4):
            raise ValueError(f"a video's fps must be a positive number, got {fps!r}")
        return _checked_video(Video(np.stack(images), None if fps is None else float(fps)))
    if isinstance(source, bytes):
        return _decode_video(source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"a video must be a data: URL, a local file or base64 data, got {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header or not header.startswith(("data:video/", "data:image/")):
            raise ValueError("a video data URL must look like data:video/<format>;base64,<data>")
        return _decode_video(_b64decode(payload, MAX_VIDEO_BYTES, "video"))
    if source.startswith(("http://", "https://")):
        return _decode_video(fetch(source, MAX_VIDEO_BYTES, fetch_timeout, "video"))
    if source.startswith("file://") or Path(source).is_absolute():
        return _decode_video(_read_local(source.removeprefix("file://"), allowed_local_path, MAX_VIDEO_BYTES))
    return _decode_video(_b64decode(source, MAX_VIDEO_BYTES, "video"))


def _decode_video(data: bytes) -> Video:
    try:
        return _decode_animated_image(data)
    except (OSError, Image.DecompressionBombError, SyntaxError):
        pass
    try:
        import av  # optional: containers PIL does not read (MP4, WebM, ...)
    except ImportError:
        raise ValueError(
            "the video cannot be decoded: not an animated image (GIF, WebP, PNG), and other formats need PyAV"
        ) from None
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            fps = float(stream.average_rate) if stream.average_rate else None
    except (av.error.FFmpegError, IndexError) as error:
        raise ValueError(f"the video cannot be decoded ({error})") from None
    if not frames:
        raise ValueError("the video has no frames")
    return _checked_video(Video(np.stack(frames), fps))


def _decode_animated_image(data: bytes) -> Video:
    image = Image.open(io.BytesIO(data))
    count = getattr(image, "n_frames", 1)
    if count * image.width * image.height > MAX_VIDEO_PIXELS:
        raise ValueError(f"the video is too large: {count} frames of {image.width}x{image.height}")
    frames, durations = [], []
    for frame in ImageSequence.Iterator(image):
        frames.append(np.asarray(frame.convert("RGB")))
        durations.append(float(frame.info.get("duration", 0) or 0))
    return _checked_video(Video(np.stack(frames), frame_rate_of(durations)))


def _checked_video(video: Video) -> Video:
    frames = video.frames
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise ValueError(f"a video must be uint8 RGB frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    if frames.size // 3 > MAX_VIDEO_PIXELS:
        raise ValueError(f"the video is too large: {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]}")
    return video


def fetch(url: str, limit: int, timeout: float, kind: str) -> bytes:
    """The body of an http(s) GET of `url`: at most `limit` bytes, the whole fetch within `timeout` seconds;
    ValueError naming the failure (status, timeout, size, unreachable host)."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "srt"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ValueError(f"the {kind} at {url} is too large: {declared} bytes, more than {limit}")
            pieces, size = [], 0
            while piece := response.read(FETCH_PIECE_BYTES):
                size += len(piece)
                if size > limit:
                    raise ValueError(f"the {kind} at {url} is too large: more than {limit} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError
                pieces.append(piece)
    except urllib.error.HTTPError as error:
        raise ValueError(f"fetching the {kind} at {url} failed: HTTP {error.code}") from None
    except TimeoutError:
        raise ValueError(f"fetching the {kind} at {url} took longer than {timeout:g} s") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ValueError(f"fetching the {kind} at {url} failed: {reason}") from None
    return b"".join(pieces)


def _b64decode(payload: str, limit: int = MAX_IMAGE_BYTES, kind: str = "image") -> bytes:
    if len(payload) * 3 // 4 > limit:
        raise ValueError(f"the {kind} is too large: more than {limit} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {kind} data is not valid base64") from None


def _read_local(path: str, allowed_local_path: str | None, limit: int = MAX_IMAGE_BYTES) -> bytes:
    if allowed_local_path is None:
        raise ValueError("local media files are not allowed; start the server with --allowed-local-media-path")
    file, allowed = Path(path).resolve(), Path(allowed_local_path).resolve()
    if not file.is_relative_to(allowed):
        raise ValueError(f"the file {path} is outside --allowed-local-media-path")
    if not file.is_file():
        raise ValueError(f"the file {path} does not exist")
    if file.stat().st_size > limit:
        raise ValueError(f"the file is too large: more than {limit} bytes")
    return file.read_bytes()


def _decode(data: bytes) -> Image.Image:
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is too large: more than {MAX_IMAGE_BYTES} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        _checked(image)
        image.load()  # decodes now: a truncated file fails here, not later in the processor
    except ValueError:
        raise
    except (OSError, Image.DecompressionBombError, SyntaxError) as error:
        raise ValueError(f"the image cannot be decoded ({error})") from None
    return image.convert("RGB")


def _checked(image: Image.Image) -> Image.Image:
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is too large: {image.width}x{image.height} pixels (at most {MAX_IMAGE_PIXELS})")
    return image
