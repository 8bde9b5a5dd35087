"""Image parts of OpenAI chat messages: `{"type": "image_url", "image_url": {"url": ...}}`.

The chat template renders each such part as the image placeholder (`<|image|>`); the URLs, in message order,
become the request's `image_data` (data: URLs, or local files under --allowed-local-media-path).
"""

from __future__ import annotations

from typing import Any

from srt.entrypoints.openai.response_parts import RequestError


def is_image_part(part: dict[str, Any]) -> bool:
    return part.get("type") == "image_url"


def image_url(part: dict[str, Any], message_index: int) -> str:
    """The URL of an image part; RequestError naming `messages` when it has none."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"messages[{message_index}].content: an image_url part needs image_url.url", "messages")
    return url


def chat_image_urls(messages: list) -> list[str]:
    """Every image part's URL, in the order the template renders them."""
    urls = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for part in message.content:
                part = part if isinstance(part, dict) else part.model_dump()
                if is_image_part(part):
                    urls.append(image_url(part, i))
    return urls
