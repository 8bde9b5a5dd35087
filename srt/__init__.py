"""srt: a serving runtime for Google's Gemma 4 models."""

from __future__ import annotations

__version__ = "0.1.0"
