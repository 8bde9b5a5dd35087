"""The result dicts of `/generate` and `Engine.generate`, built up from a request's step outputs.

    {"text": str, "output_ids": [int], "meta_info": {"id", "prompt_tokens", "completion_tokens",
     "cached_tokens", "spec_verify_ct" and "spec_accepted_tokens" (speculative decoding: verify rounds and
     accepted drafts; 0 without it), "finish_reason": {"type": "stop"|"length"|"abort", "matched"?} | None,
     "e2e_latency",
     and with return_logprob: "input_token_logprobs", "output_token_logprobs" ([logprob, token_id, text]),
     and with top_logprobs_num: "input_top_logprobs", "output_top_logprobs" (a list of those per position)}}

A streamed chunk has the same keys, with `text`, `output_ids` and the logprob lists holding only what is
new since the previous chunk (counts and finish_reason are the totals so far); with `return_emit_ts` its
meta_info also has "emit_ts": {"scheduler", "detokenizer", "tokenizer_manager"}, when the step's tokens left
each process (wall-clock seconds; io_struct.EmitTimes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

from srt.managers.io_struct import StrOutput, TokenLogprob


class TokenTexts:
    """Text and bytes of single tokens, for logprob entries."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)
        self._byte_decoder = {char: byte for byte, char in _bytes_to_unicode().items()}

    def _text(self, token_id: int) -> str:
        """The token's text; a token holding part of a UTF-8 character is shown as OpenAI does, by its bytes
        ("bytes:\\xe4\\xbd"), so that different partial tokens never share a name."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in self.bytes(token_id))
        return text

    def _bytes(self, token_id: int) -> bytes:
        """The token's exact bytes (part of a UTF-8 character stays partial, unlike its text)."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id not in self.special_ids and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)  # byte-level BPE (GPT-2 alphabet)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return piece.replace("\u2581", " ").encode()


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@dataclass
class ResultBuilder:
    """Accumulates one request's outputs (`add`); `chunk()` gives the incremental dict, `result()` the whole one."""

    rid: str
    return_logprob: bool
    top_logprobs_num: int
    texts: TokenTexts | None  # token texts in logprob entries (None: leave them out, as SGLang does)
    created: float = field(default_factory=time.monotonic)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    finished: bool = False

    def add(self, out: StrOutput) -> None:
        """Record a step output."""
        o = out.output
        self.text += out.text
        self.output_ids += o.new_token_ids
        self.input_logprobs += o.input_logprobs
        self.output_logprobs += o.output_logprobs
        self.finished = o.finished
        self.meta = {
            "id": self.rid,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens,
            "spec_verify_ct": o.spec_verify_ct,
            "spec_accepted_tokens": o.spec_accepted_tokens,
            "finish_reason": o.finished_reason.to_json() if o.finished_reason else None,
            "e2e_latency": time.monotonic() - self.created,
        }

    def chunk(self, out: StrOutput) -> dict:
        """The streamed chunk of `out`, the step output `add` recorded last (only streams need one)."""
        o = out.output
        return {
            "text": out.text,
            "output_ids": list(o.new_token_ids),
            "meta_info": {**self.meta, **self._logprobs(o.input_logprobs, o.output_logprobs)},
        }

    def result(self) -> dict:
        return {
            "text": self.text,
            "output_ids": self.output_ids,
            "meta_info": {**self.meta, **self._logprobs(self.input_logprobs, self.output_logprobs)},
        }

    def _logprobs(self, inputs: list[TokenLogprob], outputs: list[TokenLogprob]) -> dict:
        if not self.return_logprob:
            return {}
        meta = {
            "input_token_logprobs": [self._entry(lp.logprob, lp.token_id) for lp in inputs],
            "output_token_logprobs": [self._entry(lp.logprob, lp.token_id) for lp in outputs],
        }
        if self.top_logprobs_num:
            meta["input_top_logprobs"] = [self._top(lp) for lp in inputs]
            meta["output_top_logprobs"] = [self._top(lp) for lp in outputs]
        return meta

    def _entry(self, logprob: float | None, token_id: int) -> list:
        return [logprob, token_id, self.texts.text(token_id) if self.texts else None]

    def _top(self, lp: TokenLogprob) -> list | None:
        if lp.logprob is None:
            return None  # the first prompt token: nothing predicts it
        return [self._entry(value, token_id) for token_id, value in lp.top]
