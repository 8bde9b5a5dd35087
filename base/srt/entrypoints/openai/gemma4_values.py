"""Gemma 4's value notation (tool calls and responses) to Python values, and the JSON arguments OpenAI wants.

Gemma writes arguments as `{key:value,...}`: keys bare (or between `<|"|>` tokens), strings between `<|"|>`
tokens (anything may stand inside them, braces and commas included), numbers, `true` / `false`, `null`,
nested objects and arrays. It is not JSON, so `json.loads` cannot read it:

    call:get_weather{city:<|"|>Paris, {FR}<|"|>,days:3,opts:{metric:true},tags:[<|"|>a<|"|>]}
         -> {"city": "Paris, {FR}", "days": 3, "opts": {"metric": true}, "tags": ["a"]}
"""

from __future__ import annotations

import json
import re
from typing import Any

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NULLS = ("null", "None", "none")  # the published template renders a Python None as `None`


class GemmaSyntaxError(ValueError):
    """The text is not a value in Gemma's notation."""


def parse_arguments(text: str) -> dict[str, Any]:
    """`{key:value,...}` (the whole text) as a dict; GemmaSyntaxError if it is anything else."""
    reader = _Reader(text)
    value = reader.value()
    reader.skip_space()
    if reader.pos != len(text):
        raise GemmaSyntaxError(f"unexpected text after the arguments at {reader.pos}: {text[reader.pos :][:20]!r}")
    if not isinstance(value, dict):
        raise GemmaSyntaxError("arguments must be an object")
    return value


def arguments_json(arguments: dict[str, Any]) -> str:
    """The OpenAI `arguments` string: JSON, non-ASCII kept as is."""
    return json.dumps(arguments, ensure_ascii=False)


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def fail(self, what: str) -> GemmaSyntaxError:
        return GemmaSyntaxError(f"expected {what} at {self.pos}: {self.text[self.pos :][:20]!r}")

    def value(self) -> Any:
        self.skip_space()
        if self.text.startswith(QUOTE, self.pos):
            return self.string()
        if self.text.startswith("{", self.pos):
            return self.object()
        if self.text.startswith("[", self.pos):
            return self.array()
        return self.scalar()

    def string(self) -> str:
        start = self.pos + len(QUOTE)
        end = self.text.find(QUOTE, start)
        if end == -1:
            raise self.fail('a closing <|"|>')
        self.pos = end + len(QUOTE)
        return self.text[start:end]

    def object(self) -> dict[str, Any]:
        self.pos += 1
        out: dict[str, Any] = {}
        self.skip_space()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            self.skip_space()
            key = self.key()
            self.skip_space()
            if not self.text.startswith(":", self.pos):
                raise self.fail("':'")
            self.pos += 1
            out[key] = self.value()
            if self.separator("}"):
                return out

    def key(self) -> str:
        if self.text.startswith(QUOTE, self.pos):
            return self.string()
        end = self.pos
        while end < len(self.text) and self.text[end] not in ':,{}[]<"' and not self.text[end].isspace():
            end += 1
        if end == self.pos:
            raise self.fail("a key")
        key, self.pos = self.text[self.pos : end], end
        return key

    def array(self) -> list[Any]:
        self.pos += 1
        out: list[Any] = []
        self.skip_space()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            if self.separator("]"):
                return out

    def separator(self, close: str) -> bool:
        """Past a ',' (False) or the closing bracket (True)."""
        self.skip_space()
        if self.text.startswith(",", self.pos):
            self.pos += 1
            return False
        if self.text.startswith(close, self.pos):
            self.pos += 1
            return True
        raise self.fail(f"',' or {close!r}")

    def scalar(self) -> Any:
        end = self.pos
        while end < len(self.text) and self.text[end] not in ",}]":
            if self.text.startswith("<|", end):
                break  # a special token cannot be part of a bare value
            end += 1
        word = self.text[self.pos : end].strip()
        if not word:
            raise self.fail("a value")
        self.pos = end
        if word in ("true", "false"):
            return word == "true"
        if word in _NULLS:
            return None
        if _NUMBER.fullmatch(word):
            return float(word) if any(c in word for c in ".eE") else int(word)
        raise GemmaSyntaxError(f"not a value: {word!r}")
