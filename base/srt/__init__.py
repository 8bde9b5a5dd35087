"""srt: a serving runtime for Google's Gemma 4 models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from srt.entrypoints.engine import Engine

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    # `import srt` stays cheap (no torch, no zmq): the Engine is imported on first use.
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")
