r"""Incremental detokenization of one request: text deltas that never split a character, and stop strings.

Decoding each new token alone is wrong twice over: byte-level tokens can hold part of a UTF-8 character
(decoded alone they give U+FFFD), and some decoders change a token's text by what precedes it. So, as in
vLLM and SGLang, we decode a short window of recent tokens twice, with and without the new ones, and emit
the difference once it no longer ends in U+FFFD:

    ids:   [ ......... | prefix_offset ...... | read_offset ...... new ]
                         \__ prefix_text __/
                         \_______________ new_text ________________/
    delta = new_text[len(prefix_text):]       (held back while it ends in U+FFFD)

Stop strings are searched in the decoded text. Text that could be the start of a stop string is held back
too, so a stream never shows text that the final answer then cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class DetokenizeResult:
    """What one batch of new tokens adds to the request's text."""

    text: str  # text safe to show now
    num_tokens: int  # how many of the new tokens belong to the output (fewer once a stop string matched)
    stop_matched: str | None  # the stop string that ended the request, if one did


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a batch of tokens at a time."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (stop string cut off once matched)
        self.sent = 0  # characters of `text` already returned
        self.stopped: str | None = None

    def add(self, new_ids: Sequence[int], finished: bool = False) -> DetokenizeResult:
        """Take the next output tokens; `finished` (no more will come) flushes everything held back."""
        if self.stopped is not None:
            return DetokenizeResult("", 0, None)
        for i, token in enumerate(new_ids):
            self.ids.append(token)
            searched_from = len(self.text)
            self.text += self._decode_step()
            last = finished and i == len(new_ids) - 1
            if last:
                self.text += self._flush()
            if self._find_stop(searched_from):
                return DetokenizeResult(self._take(len(self.text)), i + 1, self.stopped)
        if finished and not new_ids:
            searched_from = len(self.text)
            self.text += self._flush()
            if self._find_stop(searched_from):
                return DetokenizeResult(self._take(len(self.text)), 0, self.stopped)
        end = len(self.text) if finished else len(self.text) - self._partial_stop_len()
        return DetokenizeResult(self._take(end), len(new_ids), None)

    def _decode_step(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or the new bytes end inside a character: wait for the rest
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def _flush(self) -> str:
        """Whatever is still held back, invalid bytes included: the output really ends there."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _find_stop(self, searched_from: int) -> bool:
        """Cut `text` at the earliest stop string that ends after `searched_from`; True if one matched."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = self.text.find(stop, max(0, searched_from - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        self.text, self.stopped = self.text[: best[0]], best[1]
        return True

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that a stop string starts with (it may complete later)."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out
