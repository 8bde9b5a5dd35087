"""Turning what users send as an image into a PIL image, or a ValueError that names the problem.

Accepted: PIL images, `data:image/...;base64,` URLs, bare base64 strings, and local files (a path or a
`file://` URL), which must lie under `--allowed-local-media-path`. http(s) URLs are refused: srt fetches
nothing from the network (yet).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

from PIL import Image

MAX_IMAGE_BYTES = 32 << 20  # an encoded image larger than this is refused before it is decoded
MAX_IMAGE_PIXELS = 64 << 20  # decoded width x height; PIL's own bomb check would only warn below 2x its limit


def load_image(source: object, allowed_local_path: str | None = None) -> Image.Image:
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
        raise ValueError("image URLs over http(s) are not supported; send the image as a data: URL")
    if source.startswith("file://") or Path(source).is_absolute():
        return _decode(_read_local(source.removeprefix("file://"), allowed_local_path))
    return _decode(_b64decode(source))


def _b64decode(payload: str) -> bytes:
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is too large: more than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image data is not valid base64") from None


def _read_local(path: str, allowed_local_path: str | None) -> bytes:
    if allowed_local_path is None:
        raise ValueError("local image files are not allowed; start the server with --allowed-local-media-path")
    file, allowed = Path(path).resolve(), Path(allowed_local_path).resolve()
    if not file.is_relative_to(allowed):
        raise ValueError(f"the image file {path} is outside --allowed-local-media-path")
    if not file.is_file():
        raise ValueError(f"the image file {path} does not exist")
    if file.stat().st_size > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is too large: more than {MAX_IMAGE_BYTES} bytes")
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
