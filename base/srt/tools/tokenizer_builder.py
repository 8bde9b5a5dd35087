"""A small byte-level BPE tokenizer with Gemma 4's special tokens, for tiny test checkpoints.

The BPE is trained with the `tokenizers` library on the original text under `srt/tools/data/`. Gemma 4's
control tokens keep their published ids wherever those ids fit in the tiny vocabulary (`<pad>`=0, `<eos>`=1,
`<bos>`=2, `<unk>`=3, `<|turn>`=105, `<turn|>`=106, ...); the multimodal markers, whose published ids are
above 255999, take the last ids of the vocabulary in their published order. Every other id holds a trained
token, so the vocabulary is exactly `vocab_size` entries with no holes. The full-vocabulary stand-in of the
published presets (`standin_tokenizer`) reuses the trained tokens and puts every special at its published id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PretrainedConfig, PreTrainedTokenizerFast

DATA_DIR = Path(__file__).with_name("data")
CHAT_TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")

PAD, EOS, BOS, UNK, MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
START_OF_TURN, END_OF_TURN = "<|turn>", "<turn|>"
TOOL_RESPONSE = "<|tool_response>"

# Published Gemma 4 ids below 1024 (google/gemma-4-*-it tokenizer).
_LOW_ID_TOKENS: dict[int, str] = {
    0: PAD,
    1: EOS,
    2: BOS,
    3: UNK,
    4: MASK,
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: TOOL_RESPONSE,
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: START_OF_TURN,
    106: END_OF_TURN,
}
# Published ids 255999, 256000 and 258880..258884, in that order; they go to the top of the tiny vocabulary.
_MULTIMODAL_TOKENS = ("<|image>", "<|audio>", "<|image|>", "<|audio|>", "<image|>", "<audio|>", "<|video|>")
# transformers' Gemma4Config: boi 255999, boa 256000, image 258880, audio 258881, eoi 258882, eoa 258883, video 258884.
PUBLISHED_MULTIMODAL_IDS = (255_999, 256_000, 258_880, 258_881, 258_882, 258_883, 258_884)

# Named special tokens that Gemma 4's tokenizer_config.json exposes as attributes (`tokenizer.sot_token`).
_NAMED_TOKENS = {
    "sot_token": START_OF_TURN,
    "eot_token": END_OF_TURN,
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "think_token": "<|think|>",
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "str_token": TOOL_RESPONSE,
    "etr_token": "<tool_response|>",
    "escape_token": '<|"|>',
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "image_token": "<|image|>",
    "audio_token": "<|audio|>",
}


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Every special token and its id in a tokenizer of `vocab_size` entries."""
    first_multimodal = vocab_size - len(_MULTIMODAL_TOKENS)
    if first_multimodal <= max(_LOW_ID_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for Gemma 4's special tokens")
    ids = {token: token_id for token_id, token in _LOW_ID_TOKENS.items()}
    ids.update({token: first_multimodal + i for i, token in enumerate(_MULTIMODAL_TOKENS)})
    return ids


def published_special_token_ids() -> dict[str, int]:
    """Every special token at its id in the published Gemma 4 tokenizer (262,144 entries)."""
    ids = {token: token_id for token_id, token in _LOW_ID_TOKENS.items()}
    ids.update(zip(_MULTIMODAL_TOKENS, PUBLISHED_MULTIMODAL_IDS))
    return ids


@cache
def trained_bpe(num_trained: int) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """Train a byte-level BPE of exactly `num_trained` tokens; returns (vocab by trained id, merges).

    Cached: the four tiny presets share one tokenizer and training is the same for each.
    """
    files = sorted(str(path) for path in DATA_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no tokenizer training text (*.txt) in {DATA_DIR}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=num_trained,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda item: item[1])
    if len(vocab) != num_trained:
        raise RuntimeError(
            f"BPE training produced {len(vocab)} tokens, wanted {num_trained}: add more text to {DATA_DIR}"
        )
    return tuple(vocab), tuple(tuple(merge) for merge in model["merges"])


def build_backend_tokenizer(vocab_size: int) -> Tokenizer:
    """The `tokenizers` pipeline: specials at fixed ids, trained tokens filling every other id in order."""
    specials = special_token_ids(vocab_size)
    trained, merges = trained_bpe(vocab_size - len(specials))
    free_ids = (i for i in range(vocab_size) if i not in specials.values())
    vocab = dict(specials)
    vocab.update({token: next(free_ids) for token, _ in trained})
    return backend_from_vocab(vocab, merges, specials)


def backend_from_vocab(vocab: dict[str, int], merges: Sequence[tuple[str, str]], specials: dict[str, int]) -> Tokenizer:
    """A byte-level BPE pipeline over `vocab` whose `specials` are special added tokens; it prepends `<bos>`."""
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Added tokens whose text is already in the vocabulary keep their vocabulary ids.
    tokenizer.add_special_tokens(sorted(specials, key=specials.__getitem__))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, specials[BOS])]
    )
    return tokenizer


def opens_empty_thought_channel(text_config: PretrainedConfig) -> bool:
    """Whether the chat template opens the model turn with an empty thought channel when thinking is off.

    26B-A4B and 31B do; the on-device variants E2B and E4B (the ones with per-layer inputs) do not.
    """
    return not text_config.hidden_size_per_layer_input


def chat_template(empty_thought_channel: bool) -> str:
    """The Jinja chat template; `empty_thought_channel` is baked in as the template's default.

    Gemma 4's larger checkpoints (26B-A4B, 31B) open the model turn with an empty thought channel when thinking
    is off; E2B and E4B do not.
    """
    flag = "true" if empty_thought_channel else "false"
    return f"{{%- set empty_thought_channel = {flag} -%}}\n" + CHAT_TEMPLATE_FILE.read_text()


def build_tokenizer(vocab_size: int, empty_thought_channel: bool = False) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer that adds `<bos>` and carries the Gemma 4 chat template."""
    return wrap_backend(build_backend_tokenizer(vocab_size), empty_thought_channel)


def wrap_backend(backend: Tokenizer, empty_thought_channel: bool = False) -> PreTrainedTokenizerFast:
    """`backend` as a transformers fast tokenizer with Gemma 4's named special tokens and chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        mask_token=MASK,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        extra_special_tokens=["<|video|>"],
        **_NAMED_TOKENS,
    )
    tokenizer.chat_template = chat_template(empty_thought_channel)
    return tokenizer
