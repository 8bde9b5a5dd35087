"""The tokenizer a server uses: the checkpoint's own, or, for a dummy preset, a stand-in built locally.

The detokenizer process only decodes. Where the checkpoint's `tokenizer.json` decodes exactly as its
transformers tokenizer does (no clean-up of spaces afterwards), it uses the `tokenizers` library directly:
importing transformers (and with it torch) would double the process's start-up time for nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def load_tokenizer(server_args: ServerArgs):
    """`--tokenizer-path`, else the model directory; a dummy preset gets the tiny byte-level BPE tokenizer."""
    from transformers import AutoTokenizer

    from srt.configs import presets
    from srt.tools import tokenizer_builder

    path = server_args.tokenizer_path or server_args.model_path
    if Path(path).is_dir():
        return AutoTokenizer.from_pretrained(path)
    if presets.is_preset(path):
        config = presets.preset_text_config(path)
        if config.vocab_size != presets.TINY_VOCAB_SIZE:
            # The stand-in covers ids below TINY_VOCAB_SIZE only; larger ids decode to nothing.
            logger.warning(
                "preset %s has no tokenizer: using the %d-token test tokenizer; pass --tokenizer-path for real text",
                path,
                presets.TINY_VOCAB_SIZE,
            )
        empty_thought_channel = tokenizer_builder.opens_empty_thought_channel(config)
        return tokenizer_builder.build_tokenizer(presets.TINY_VOCAB_SIZE, empty_thought_channel=empty_thought_channel)
    return AutoTokenizer.from_pretrained(path)


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
    return load_tokenizer(server_args)
