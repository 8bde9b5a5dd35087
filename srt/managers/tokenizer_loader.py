"""The tokenizer a server uses: the checkpoint's own, or, for a dummy preset, a stand-in built locally.

Tiny presets get the 1,024-token test tokenizer (`tokenizer_builder`); published presets get a stand-in of
their whole vocabulary (`standin_tokenizer`), so a random model's every token decodes to text.

The detokenizer process only decodes. Where the checkpoint's `tokenizer.json` decodes exactly as its
transformers tokenizer does (no clean-up of spaces afterwards), it uses the `tokenizers` library directly:
importing transformers (and with it torch) would double the process's start-up time for nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from srt.server_args import ServerArgs, chat_template_text

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


def load_tokenizer(server_args: ServerArgs):
    """`--tokenizer-path`, else the model directory; a dummy preset gets a stand-in (`_standin_vocab_size`). With
    `--chat-template`, that template instead of the tokenizer's own."""
    tokenizer = _load_tokenizer(server_args)
    if server_args.chat_template is not None:
        tokenizer.chat_template = chat_template_text(server_args.chat_template)
    return tokenizer


def _load_tokenizer(server_args: ServerArgs):
    from transformers import AutoTokenizer

    from srt.configs import presets
    from srt.tools import standin_tokenizer, tokenizer_builder

    path = server_args.tokenizer_path or server_args.model_path
    if Path(path).is_dir():
        return AutoTokenizer.from_pretrained(path)
    if presets.is_preset(path):
        config = presets.preset_text_config(path)
        empty_thought_channel = tokenizer_builder.opens_empty_thought_channel(config)
        standin_vocab_size = _standin_vocab_size(path)
        if standin_vocab_size is None:
            return tokenizer_builder.build_tokenizer(config.vocab_size, empty_thought_channel=empty_thought_channel)
        logger.warning(
            "preset %s has no tokenizer: using a %d-token stand-in (every id decodes to a synthetic piece such as"
            " ' ~5m9r'); pass --tokenizer-path for real text",
            path,
            standin_vocab_size,
        )
        return standin_tokenizer.load_standin_tokenizer(standin_vocab_size, empty_thought_channel)
    return AutoTokenizer.from_pretrained(path)


def load_grammar_vocab(server_args: ServerArgs, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """The vocabulary as grammars see it: the served tokenizer's token texts over the model's `vocab_size` rows;
    the grammar ends with one of `stop_token_ids` (the model's EOS ids)."""
    from srt.sampling.grammar import tokenizer_info

    return tokenizer_info(load_tokenizer(server_args), vocab_size, stop_token_ids)


def _standin_vocab_size(path: str) -> int | None:
    """The vocabulary of a published preset's full-size stand-in; None for anything else (tiny presets included:
    their 1,024-token test tokenizer is built in memory by `tokenizer_builder`)."""
    from srt.configs import presets

    if Path(path).is_dir() or not presets.is_preset(path):
        return None
    vocab_size = presets.preset_text_kwargs(path)["vocab_size"]
    return None if vocab_size == presets.TINY_VOCAB_SIZE else vocab_size


class TokenizersDecoder:
    """`decode` of a `tokenizers.Tokenizer`, with transformers' signature."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_decoder(server_args: ServerArgs):
    """What the detokenizer decodes with: `tokenizer.json` directly where that is exact, else `load_tokenizer`."""
    path = Path(server_args.tokenizer_path or server_args.model_path)
    config_file, tokenizer_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if tokenizer_file.is_file() and config_file.is_file():
        config = json.loads(config_file.read_text())
        if not config.get("clean_up_tokenization_spaces", False):
            from tokenizers import Tokenizer

            return TokenizersDecoder(Tokenizer.from_file(str(tokenizer_file)))
    standin_vocab_size = _standin_vocab_size(str(path))
    if standin_vocab_size is not None:  # its pipeline decodes exactly as the transformers wrapper does
        from srt.tools.standin_tokenizer import load_backend

        return TokenizersDecoder(load_backend(standin_vocab_size))
    return load_tokenizer(server_args)
