"""Constrained decoding with xgrammar: a request's grammar masks the tokens it may sample next.

    tokenizer manager                            scheduler                                 device
    check_grammar (a 400 if the text is bad)
    GrammarCompiler.compile (a thread, cached) ─► GrammarMatchers.matcher ─► RequestGrammar
        serialized CompiledGrammar (~40 KB)        (per request, kept on its Req)
                                                   BatchGrammar.constrain, every step:
                                                     catch up with the request's new tokens,
                                                     fill its row of a pinned bitmask ──────► copy, mask logits

Compiling (ms to seconds for big schemas and vocabularies) happens in the tokenizer manager's thread pool,
never in the scheduler's loop; xgrammar's compiler caches what it compiled. The scheduler only deserializes
(ms) and asks each step for a [rows, vocab / 32] int32 bitmask, filled on the host while the forward runs.

`RequestGrammar` follows a request's tokens by catching up (`catch_up(output_ids)` accepts the tokens it has
not seen), so sampling needs no hook after each step, and it can accept several tokens and roll them back:
speculative decoding checks drafts with `valid_prefix_len` and keeps what a verify step accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import xgrammar as xgr

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # SamplingParams fields, SGLang's names
_LENIENT_STRING_CHAR = r"[^\"\\\r\n]"  # one character of a bounded string, in xgrammar's EBNF
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[16:54:37] /project/cpp/x.cc:83: " of C++ errors


def _message(error: Exception) -> str:
    return _NATIVE_PREFIX.sub("", str(error).strip())


def _grammar(kind: str, source: str) -> xgr.Grammar:
    if kind == "json_schema":
        # compact JSON: a model cannot loop on whitespace between tokens (vLLM's json_schema "timeouts")
        ebnf = str(xgr.Grammar.from_json_schema(source, any_whitespace=False))
        # xgrammar 0.2.8 lets control characters into strings with a length bound, which JSON forbids
        return xgr.Grammar.from_ebnf(ebnf.replace(_LENIENT_STRING_CHAR, _JSON_STRING_CHAR))
    if kind == "regex":
        return xgr.Grammar.from_regex(source)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(source)
    raise ValueError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")


def check_grammar(kind: str, source: object) -> None:
    """ValueError naming `kind` when `source` is not a grammar of that kind (no tokenizer needed, fast)."""
    if not isinstance(source, str):
        raise ValueError(f"{kind} must be a string, got {type(source).__name__}")
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("json_schema must be a JSON object")
    try:
        _grammar(kind, source)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{kind} is invalid: {_message(error)}") from None


# control tokens a grammar may produce: Gemma 4's call syntax, which srt's tool-call grammar spells with them
# (entrypoints/openai/tool_grammar.py); inside a JSON string neither <|"|> (a quote) nor these parse as text
GRAMMAR_CONTROL_TOKENS = ("<|tool_call>", "<tool_call|>", '<|"|>')


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """What xgrammar needs to know of the vocabulary: each id's text (the model's rows, padding included).

    Control tokens (`<pad>`, `<|channel>`, `<|turn>`, `<|image>`, ...) are never text a grammar may produce,
    but xgrammar reads one whose vocabulary entry is its literal name as those characters: "<pad>" inside a
    JSON string. Sampled, it vanished from the decoded reply or opened a reasoning section (a JSON reply cut to
    `{"answer": ")` at temperature 1 on a tiny checkpoint). Their entries are emptied, which xgrammar takes as
    special: never allowed. The stop tokens still end a grammar; GRAMMAR_CONTROL_TOKENS stay as they are."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    vocab = tokenizer.get_vocab()
    special = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    special |= set(getattr(tokenizer, "all_special_ids", ()))
    control = special - set(stop_token_ids) - set(info.special_token_ids)
    control -= {vocab[text] for text in GRAMMAR_CONTROL_TOKENS if text in vocab}
    if not control:
        return info
    encoded = [""] * vocab_size
    for text, token_id in vocab.items():
        if token_id < vocab_size and token_id not in control:
            encoded[token_id] = text
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())


class GrammarCompiler:
    """Compiles grammars against the tokenizer (tokenizer manager side); results are cached."""

    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.compiler = xgr.GrammarCompiler(info)
        self.compile = lru_cache(maxsize=256)(self._compile)

    def _compile(self, kind: str, source: str) -> str:
        """The compiled grammar, serialized for the scheduler."""
        return self.compiler.compile_grammar(_grammar(kind, source)).serialize_json()


class GrammarMatchers:
    """Scheduler side: a matcher per constrained request. The vocabulary is loaded at the first one."""

    def __init__(self, load_info: Callable[[], xgr.TokenizerInfo]) -> None:
        self.load_info = load_info
        self._info: xgr.TokenizerInfo | None = None
        self._guard: Utf8Guard | None = None

    def matcher(self, serialized: str) -> RequestGrammar:
        if self._info is None:
            self._info = self.load_info()
            self._guard = Utf8Guard(self._info.decoded_vocab, self._info.vocab_size)
        return RequestGrammar(xgr.CompiledGrammar.deserialize_json(serialized, self._info), self._guard)


# second bytes that make ED xx xx a UTF-16 surrogate (U+D800..U+DFFF), which UTF-8 forbids
_SURROGATE_SECOND_BYTES = range(0xA0, 0xC0)


class Utf8Guard:
    """What xgrammar (0.2.8) lets through that is not UTF-8: it takes ED A0..BF xx, the bytes of a UTF-16
    surrogate, as a character of a string or class. Decoded, they become U+FFFD in the reply (and break a
    schema's maxLength: seen at temperature 1 on a tiny checkpoint). After an output ending in the lead byte ED
    (every byte-level or byte-fallback vocabulary has it alone), tokens starting with A0..BF are not allowed."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        self.ends_in_ed = frozenset(i for i, text in enumerate(decoded_vocab) if text.endswith(b"\xed"))
        self.surrogate_tails = frozenset(
            i for i, text in enumerate(decoded_vocab) if text and text[0] in _SURROGATE_SECOND_BYTES
        )
        banned = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.int64)
        banned[sorted(self.surrogate_tails)] = 1
        allowed = ~(banned.view(-1, 32) << torch.arange(32)).sum(dim=1) & 0xFFFFFFFF
        allowed[allowed >= 2**31] -= 2**32  # the bitmask's words are int32
        self.allowed_after_ed = allowed.int()  # [vocab / 32]: the bits of every token but the surrogate tails

    def allows(self, previous: int | None, token: int) -> bool:
        return previous not in self.ends_in_ed or token not in self.surrogate_tails


class RequestGrammar:
    """One request's position in its grammar. Tokens go in with `accept_tokens` (or `catch_up`); `rollback`
    takes the last ones out again."""

    def __init__(self, compiled: xgr.CompiledGrammar, guard: Utf8Guard) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.guard = guard
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.accepted: list[int] = []  # output tokens the matcher has taken

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def _last(self) -> int | None:
        return self.accepted[-1] if self.accepted else None

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Take tokens in order until one does not fit; how many were taken."""
        for count, token in enumerate(token_ids):
            token = int(token)
            if (
                self.matcher.is_terminated()
                or not self.guard.allows(self._last(), token)
                or not self.matcher.accept_token(token)
            ):
                return count
            self.accepted.append(token)
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens (rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self.accepted[-num_tokens:]

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Accept the output tokens the matcher has not seen. The sampler only draws allowed tokens, so one
        that does not fit means the request's tokens came from elsewhere: fail loudly."""
        new = output_ids[self.num_accepted :]
        taken = self.accept_tokens(new) if new else 0
        if taken != len(new):
            raise RuntimeError(f"token {new[taken]} breaks the request's grammar")

    def valid_prefix_len(self, token_ids: Sequence[int]) -> int:
        """How many leading `token_ids` the grammar allows from here (the state is left as it was)."""
        count = self.accept_tokens(token_ids)
        self.rollback(count)
        return count

    def fill_draft_masks(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Rows first_row .. first_row + len(drafts) of `bitmask`: row j allows what may follow the output and
        the first j drafts (a verify step's rows). Rows after a draft the grammar refuses, or after its stop
        token, are left as they are: acceptance (or the request) ends before them. The state is left as it was."""
        taken = 0
        for j in range(len(drafts) + 1):
            if self.terminated:
                break
            self.fill_mask(bitmask, first_row + j)
            if j == len(drafts) or self.accept_tokens(drafts[j : j + 1]) == 0:
                break
            taken += 1
        self.rollback(taken)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [rows, vocab / 32] bitmask: bit i set = token i allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self._last() in self.guard.ends_in_ed:
            bitmask[row] &= self.guard.allowed_after_ed


@dataclass(eq=False)
class BatchGrammar:
    """The constrained rows of one batch sampler: their grammars, token lists and bitmask buffers."""

    rows: list[int]
    grammars: list[RequestGrammar]
    output_ids: list[Sequence[int]]  # each request's live output list (the scheduler appends to it)
    host_mask: torch.Tensor  # [batch, words] int32, pinned on CUDA
    device_mask: torch.Tensor
    constrained: torch.Tensor  # [batch] bool on the device

    @classmethod
    def build(
        cls, grammars: Sequence[RequestGrammar | None], output_ids: Sequence[Sequence[int]], vocab_size: int,
        device: torch.device,
    ) -> BatchGrammar | None:  # fmt: skip
        """None when no row is constrained."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return None
        host = xgr.allocate_token_bitmask(len(grammars), vocab_size)
        if device.type == "cuda":
            host = host.pin_memory()
        flags = torch.zeros(len(grammars), dtype=torch.bool)
        flags[rows] = True
        return cls(
            rows=rows,
            grammars=[grammars[row] for row in rows],
            output_ids=[output_ids[row] for row in rows],
            host_mask=host,
            device_mask=torch.empty_like(host, device=device),
            constrained=flags.to(device),
        )

    def constrain(
        self, logits: torch.Tensor, greedy_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of `logits` [batch, vocab] with every disallowed token of a constrained row at -inf, and
        `greedy_ids` with the constrained rows' argmax taken over what is allowed. Free rows are unchanged.

        The host mask is refilled only after the host read the step before's tokens (the scheduler does not
        overlap steps of constrained requests), so its previous copy to the device has finished."""
        self.host_mask.fill_(-1)  # all bits set: free rows allow every token
        for row, grammar, output_ids in zip(self.rows, self.grammars, self.output_ids, strict=True):
            grammar.catch_up(output_ids)
            grammar.fill_mask(self.host_mask, row)
        self.device_mask.copy_(self.host_mask, non_blocking=True)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, self.device_mask, vocab_size=logits.shape[-1])
        if greedy_ids is not None:
            greedy_ids = torch.where(self.constrained, masked.argmax(dim=-1), greedy_ids)
        return masked, greedy_ids


def mask_verify_rows(
    logits: torch.Tensor, constrained: Sequence[tuple[RequestGrammar, Sequence[int], int, Sequence[int]]]
) -> torch.Tensor:
    """A copy of a verify step's `logits` [rows, vocab] where each constrained request's rows allow only what
    its grammar allows there. `constrained`: (grammar, output ids, first verify row, drafts) per request; its
    row j is scored after the output and the first j drafts. A draft the grammar refuses is then never
    accepted (greedy: the row's choice is allowed and the draft is not; sampled: its probability is 0), so
    every token a round emits fits the grammar."""
    host = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    host.fill_(-1)  # all bits set: other requests' rows are left alone
    for grammar, output_ids, first_row, drafts in constrained:
        grammar.catch_up(output_ids)
        grammar.fill_draft_masks(host, first_row, drafts)
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, host.to(logits.device), vocab_size=logits.shape[-1])
    return masked
