"""The stand-in tokenizer of a published preset served with `--load-format dummy`: the model's whole vocabulary.

A random model samples ids anywhere in [0, vocab_size). With the 1,024-token test tokenizer the ids above it
decode to nothing, so a stream would carry no text and a client could not time tokens. This tokenizer has
exactly `vocab_size` entries, every one of which decodes on its own to a distinct piece of text:

    id  0 ............................ 1016 | 1017 ....................................... vocab_size - 1
        Gemma 4's control tokens at their     | one synthetic piece per id, " ~" + the id in base 36
        published ids (<pad> 0 .. <turn|> 106) | (1017 -> " ~s9", 262143 -> " ~5m9r"), except the
        and the tiny BPE's trained tokens on   | multimodal markers at their published ids 255999,
        the other ids (the tiny tokenizer's)   | 256000 and 258880..258884

Text encodes with the trained tokens only, exactly as with the tiny tokenizer (chat prompts tokenize
sensibly); the synthetic pieces are only ever decoded, so a random model streams one piece per token.
Building takes about a second; the `tokenizers` JSON is cached under $XDG_CACHE_HOME/srt/tokenizers (default
~/.cache/srt/tokenizers), keyed by the vocab size, VERSION and a hash of the training text.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from srt import envs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

VERSION = 1  # bump when the layout above changes: cached files of older versions are then ignored
SYNTHETIC_MARK = "~"  # no trained token starts with " ~", so no synthetic piece can equal a trained one
BYTE_LEVEL_SPACE = "\u0120"  # how byte-level BPE vocabularies write a space ("Ġ")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def base36(number: int) -> str:
    digits = ""
    while True:
        number, digit = divmod(number, 36)
        digits = _DIGITS[digit] + digits
        if number == 0:
            return digits


def synthetic_piece(token_id: int) -> str:
    """The text a synthetic id decodes to."""
    return f" {SYNTHETIC_MARK}{base36(token_id)}"


def cache_dir() -> Path:
    return envs.cache_home() / "tokenizers"


def cache_file(vocab_size: int) -> Path:
    """Where the stand-in of `vocab_size` tokens is cached; new training text gives a new file."""
    from srt.tools.tokenizer_builder import DATA_DIR

    digest = hashlib.sha256()
    for path in sorted(DATA_DIR.glob("*.txt")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return cache_dir() / f"gemma4-standin-v{VERSION}-{vocab_size}-{digest.hexdigest()[:12]}.json"


def build_backend(vocab_size: int) -> Tokenizer:
    """Build the stand-in's `tokenizers` pipeline (no cache)."""
    from srt.configs.presets import TINY_VOCAB_SIZE
    from srt.tools import tokenizer_builder

    specials = tokenizer_builder.published_special_token_ids()
    if vocab_size <= max(specials.values()):
        raise ValueError(f"vocab_size {vocab_size} is too small for Gemma 4's published special-token ids")
    # The tiny tokenizer's trained tokens, on the same ids: its free ids below its multimodal markers.
    num_trained = TINY_VOCAB_SIZE - len(tokenizer_builder.special_token_ids(TINY_VOCAB_SIZE))
    trained, merges = tokenizer_builder.trained_bpe(num_trained)
    taken = set(specials.values())
    free_ids = (i for i in range(vocab_size) if i not in taken)
    vocab = dict(specials)
    vocab.update({token: next(free_ids) for token, _ in trained})
    for token_id in free_ids:
        piece = BYTE_LEVEL_SPACE + synthetic_piece(token_id)[1:]
        if piece in vocab:
            raise RuntimeError(f"synthetic piece {piece!r} equals a trained token: change SYNTHETIC_MARK")
        vocab[piece] = token_id
    return tokenizer_builder.backend_from_vocab(vocab, merges, specials)


def load_backend(vocab_size: int) -> Tokenizer:
    """The stand-in's `tokenizers` pipeline from the cache; built and cached first when absent."""
    path = cache_file(vocab_size)
    if path.is_file():
        return Tokenizer.from_file(str(path))
    start = time.perf_counter()
    tokenizer = build_backend(vocab_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tokenizer.save(str(partial))
        # atomic: the tokenizer and detokenizer processes of one server may build it at the same time
        os.replace(partial, path)
    except OSError as error:
        logger.warning("cannot cache the stand-in tokenizer in %s (%s); it is rebuilt on every start", path, error)
    else:
        logger.info(
            "built the %d-token stand-in tokenizer in %.1f s: %s", vocab_size, time.perf_counter() - start, path
        )
    return tokenizer


def load_standin_tokenizer(vocab_size: int, empty_thought_channel: bool = False) -> PreTrainedTokenizerFast:
    """The stand-in as a transformers tokenizer with Gemma 4's chat template."""
    from srt.tools.tokenizer_builder import wrap_backend

    return wrap_backend(load_backend(vocab_size), empty_thought_channel)
