r"""Gemma 4's thinking in a model's output (`--reasoning-parser gemma4`), whole or as a stream of text deltas.

With thinking on (`enable_thinking`), Gemma 4 writes its thoughts in a channel before the answer:

    <|channel>thought\nfirst, the user wants ...<channel|>The answer is 4.
              \_label_/ \____ reasoning_content ____/ \__ content __/

The channel's label (up to the first newline) is dropped. An output that ends inside the channel (out of
tokens) is all reasoning; an output without a channel is all content. Markers split across deltas are held
back until the next delta decides, so a stream never shows part of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.entrypoints.openai.tool_parser import partial_marker_len

CHANNEL_START, CHANNEL_END = "<|channel>", "<channel|>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class Gemma4ReasoningParser:
    """One output's thoughts and answer, fed text deltas in order (`feed`), then `finish()`."""

    def __init__(self) -> None:
        self.pending = ""
        self.state = "content"  # "content", "label" (inside the channel, before its newline), "reasoning"

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.pending += text
        while True:
            if self.state == "label":
                newline = self.pending.find("\n")
                close = self.pending.find(CHANNEL_END)
                if close != -1 and (newline == -1 or close < newline):
                    self.pending, self.state = self.pending[close + len(CHANNEL_END) :], "content"
                    continue  # an empty channel: <|channel>thought<channel|>
                if newline == -1:
                    return out
                self.pending, self.state = self.pending[newline + 1 :], "reasoning"
                continue
            marker = CHANNEL_START if self.state == "content" else CHANNEL_END
            found = self.pending.find(marker)
            if found == -1:
                keep = partial_marker_len(self.pending, marker)
                self._emit(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return out
            self._emit(out, self.pending[:found])
            self.pending = self.pending[found + len(marker) :]
            self.state = "label" if self.state == "content" else "content"

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self.state != "label":
            self._emit(out, self.pending)
        self.pending = ""
        return out

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self.state == "reasoning":
            out.reasoning += text
        else:
            out.content += text


def parse_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None when the output has no thought channel, content) of a whole output."""
    parser = Gemma4ReasoningParser()
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if reasoning or CHANNEL_START in text else None), first.content + last.content
