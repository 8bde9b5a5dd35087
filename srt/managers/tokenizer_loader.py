"""The tokenizer a server uses: the checkpoint's own, or, for a dummy preset, a stand-in built locally."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from srt.configs import presets
from srt.server_args import ServerArgs
from srt.tools import tokenizer_builder

logger = logging.getLogger(__name__)


def load_tokenizer(server_args: ServerArgs) -> PreTrainedTokenizerBase:
    """`--tokenizer-path`, else the model directory; a dummy preset gets the tiny byte-level BPE tokenizer."""
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
        # As make_checkpoint: on-device variants (with per-layer inputs) open the model turn without a thought
        # channel, 26B-A4B and 31B with an empty one.
        on_device = bool(config.hidden_size_per_layer_input)
        return tokenizer_builder.build_tokenizer(presets.TINY_VOCAB_SIZE, empty_thought_channel=not on_device)
    return AutoTokenizer.from_pretrained(path)
