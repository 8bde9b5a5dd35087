"""Image and video parts of OpenAI chat messages: `{"type": "image_url", "image_url": {"url": ...}}` and
`{"type": "video_url", "video_url": {"url": ...}}`.

The chat template renders each such part as the image or video placeholder (`<|image|>`, `<|video|>`); the URLs,
in message order, become the request's `image_data` and `video_data` (data: URLs, or local files under
--allowed-local-media-path).
"""

from __future__ import annotations

from typing import Any

from srt.entrypoints.openai.response_parts import RequestError

MEDIA_PARTS = {"image_url": "image", "video_url": "video"}  # part type -> the chat template's part type


def media_kind(part: dict[str, Any]) -> str | None:
    """ "image" or "video" for a media part (what the template renders), None for any other part."""
    return MEDIA_PARTS.get(part.get("type"))


def image_url(part: dict[str, Any], message_index: int) -> str:
    """The URL of an image or video part; RequestError naming `messages` when it has none."""
    kind = part.get("type")
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"messages[{message_index}].content: a {kind} part needs {kind}.url", "messages")
    return url


def chat_media_urls(messages: list) -> tuple[list[str], list[str]]:
    """Every image part's URL and every video part's URL, each in the order the template renders them."""
    found: dict[str, list[str]] = {"image": [], "video": []}
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for part in message.content:
                part = part if isinstance(part, dict) else part.model_dump()
                kind = media_kind(part)
                if kind is not None:
                    found[kind].append(image_url(part, i))
    return found["image"], found["video"]
