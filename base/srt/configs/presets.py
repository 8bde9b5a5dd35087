"""Built-in model presets.

The published presets come from `gemma4_variants.json` (the text part of each Gemma 4 checkpoint as
`Gemma4TextConfig` keyword arguments). Each has a `tiny-` twin with small dimensions and the same structure:
layer pattern, KV sharing, per-layer inputs, double-wide MLP, k_eq_v, MoE, heterogeneous head dims and
softcapping. Tiny presets are what the correctness tests and `make serve` run on CPU.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from transformers import Gemma4AssistantConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

_VARIANTS_FILE = Path(__file__).with_name("gemma4_variants.json")
PUBLISHED = ("gemma-4-E2B-it", "gemma-4-E4B-it", "gemma-4-26B-A4B-it", "gemma-4-31B-it")

TINY_VOCAB_SIZE = 1024
TINY_SLIDING_WINDOW = 16


def _tiny_layer_types(period: int, groups: int) -> list[str]:
    """`groups` repetitions of (period - 1) sliding layers then one full layer."""
    return (["sliding_attention"] * (period - 1) + ["full_attention"]) * groups


# Small dimensions for each variant. Layer periods match the published pattern (E2B 4:1, others 5:1),
# and the share of KV-shared layers is kept so YOCO has the same structure to exploit.
_TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma-4-E2B-it": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=10,
        layer_types=_tiny_layer_types(5, 2),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=5,
        hidden_size_per_layer_input=16,
    ),
    "gemma-4-E4B-it": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=12,
        layer_types=_tiny_layer_types(6, 2),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=6,
        hidden_size_per_layer_input=16,
    ),
    "gemma-4-26B-A4B-it": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        layer_types=_tiny_layer_types(6, 1),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_experts=16,
        top_k_experts=4,
        moe_intermediate_size=32,
        max_position_embeddings=4096,
    ),
    "gemma-4-31B-it": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=12,
        layer_types=_tiny_layer_types(6, 2),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        max_position_embeddings=4096,
    ),
}


@cache
def _variants() -> dict[str, Any]:
    return json.loads(_VARIANTS_FILE.read_text())


def preset_names() -> list[str]:
    """Every preset name: the published ones and their `tiny-` twins."""
    return [*PUBLISHED, *(f"tiny-{name}" for name in PUBLISHED)]


def is_preset(name: str) -> bool:
    return name in preset_names()


def is_moe_preset(name: str) -> bool:
    return _variants()[name.removeprefix("tiny-")]["kind"] == "moe"


def preset_text_kwargs(name: str) -> dict[str, Any]:
    """`Gemma4TextConfig` keyword arguments of a preset (a fresh copy each call)."""
    if not is_preset(name):
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    base = name.removeprefix("tiny-")
    kwargs = copy.deepcopy(_variants()[base]["text"])
    kwargs.setdefault("max_position_embeddings", 131072)
    if name.startswith("tiny-"):
        kwargs.update(copy.deepcopy(_TINY_OVERRIDES[base]))
        kwargs["vocab_size"] = TINY_VOCAB_SIZE
        kwargs["vocab_size_per_layer_input"] = TINY_VOCAB_SIZE
        kwargs["sliding_window"] = TINY_SLIDING_WINDOW
    if kwargs.get("num_experts"):
        kwargs["enable_moe_block"] = True
    return kwargs


def preset_text_config(name: str) -> Gemma4TextConfig:
    """The transformers config of a preset."""
    if is_assistant_preset(name):
        raise ValueError(f"{name!r} is an MTP assistant preset; it has a Gemma4AssistantConfig (assistant_config)")
    return Gemma4TextConfig(**preset_text_kwargs(name))


# ---- the vision tower: every published checkpoint is `Gemma4ForConditionalGeneration` ----

# A tiny tower with the published structure (patch size, pooling, clipped linears or standardization, axial RoPE):
# real images still patchify to 16x16x3 = 768 values per patch, so transformers' image processor runs unchanged.
_TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
)
# keys of `vision_towers` entries that are not Gemma4VisionConfig arguments
_VISION_NOTES = ("soft_tokens_per_image",)


def preset_vision_kwargs(name: str) -> dict[str, Any]:
    """`Gemma4VisionConfig` keyword arguments of a preset's vision tower (a fresh copy each call)."""
    if not is_preset(name):
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    base = name.removeprefix("tiny-")
    tower = copy.deepcopy(_variants()["vision_towers"][_variants()[base]["vision"]])
    for key in _VISION_NOTES:
        tower.pop(key, None)
    if name.startswith("tiny-"):
        tower.update(_TINY_VISION)
    return tower


def multimodal_token_ids(vocab_size: int) -> dict[str, int]:
    """`Gemma4Config` ids of the image / video / audio markers in a vocabulary of `vocab_size` entries: the
    published ids, or for the tiny vocabulary the last ids, where its tokenizer puts them (`tokenizer_builder`)."""
    published = _variants()["special_token_ids"]
    names = ("boi", "boa", "image", "audio", "eoi", "eoa", "video")  # published order, as in tokenizer_builder
    if vocab_size == TINY_VOCAB_SIZE:
        ids = dict(zip(names, range(vocab_size - len(names), vocab_size), strict=True))
    else:
        ids = {name: published[name] if name != "eoa" else 258_883 for name in names}
    return {
        "boi_token_id": ids["boi"],
        "eoi_token_id": ids["eoi"],
        "image_token_id": ids["image"],
        "video_token_id": ids["video"],
        "boa_token_id": ids["boa"],
        "eoa_token_index": ids["eoa"],
        "audio_token_id": ids["audio"],
    }


def preset_config(name: str) -> Gemma4Config:
    """The multimodal transformers config of a preset (text model + vision tower, no audio tower), the shape of
    the published `Gemma4ForConditionalGeneration` checkpoints."""
    text = preset_text_config(name)
    vision = Gemma4VisionConfig(**preset_vision_kwargs(name))
    return Gemma4Config(text_config=text, vision_config=vision, **multimodal_token_ids(text.vocab_size))


# ---- MTP assistants (drafters): `gemma-4-*-it-assistant`, one per published target ----

ASSISTANT_SUFFIX = "-assistant"
# The tiny assistants fit their tiny targets: backbone = the target's hidden size, the target's head dims and
# KV heads per layer type; 32 centroids of 32 tokens each cover TINY_VOCAB_SIZE.
_TINY_ASSISTANT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    layer_types=_tiny_layer_types(4, 1),
    num_attention_heads=4,
    head_dim=32,
    global_head_dim=64,
    sliding_window=TINY_SLIDING_WINDOW,
    vocab_size=TINY_VOCAB_SIZE,
)
_TINY_CENTROIDS = dict(num_centroids=32, centroid_intermediate_top_k=4)


def assistant_preset_names() -> list[str]:
    """`gemma-4-*-it-assistant` and their `tiny-` twins."""
    return [name + ASSISTANT_SUFFIX for name in preset_names()]


def is_assistant_preset(name: str) -> bool:
    return name in assistant_preset_names()


def _published_assistant(target: str) -> dict[str, Any]:
    """The published assistant's values; 26B/31B are recorded only in part (unverified), so the missing ones
    come from the E4B assistant (layer pattern, head dims, RoPE) and the target (KV heads of full layers)."""
    drafters = _variants()["assistants_mtp_drafters"]
    name = target + ASSISTANT_SUFFIX
    if name in drafters:
        return copy.deepcopy(drafters[name])
    partial = copy.deepcopy(drafters[f"{name} (unverified)"])
    values = copy.deepcopy(drafters["gemma-4-E4B-it" + ASSISTANT_SUFFIX])
    values["text_config"].update(partial.pop("text_config"))
    values.update(partial)
    values["text_config"]["num_global_key_value_heads"] = _variants()[target]["text"]["num_global_key_value_heads"]
    return values


def assistant_config_kwargs(name: str) -> dict[str, Any]:
    """`Gemma4AssistantConfig` keyword arguments of an assistant preset, `text_config` as a dict."""
    if not is_assistant_preset(name):
        raise ValueError(f"unknown assistant preset {name!r}; known: {', '.join(assistant_preset_names())}")
    target = name.removesuffix(ASSISTANT_SUFFIX)
    values = _published_assistant(target.removeprefix("tiny-"))
    text = values["text_config"]
    text.setdefault("max_position_embeddings", 131072)
    text["num_kv_shared_layers"] = text.get("num_hidden_layers", 4)
    if target.startswith("tiny-"):
        tiny_target = preset_text_kwargs(target)
        text.update(copy.deepcopy(_TINY_ASSISTANT))
        text["num_kv_shared_layers"] = text["num_hidden_layers"]
        text["num_key_value_heads"] = tiny_target["num_key_value_heads"]
        if "num_global_key_value_heads" in tiny_target:
            text["num_global_key_value_heads"] = tiny_target["num_global_key_value_heads"]
        values["backbone_hidden_size"] = tiny_target["hidden_size"]
        if values["use_ordered_embeddings"]:
            values.update(_TINY_CENTROIDS)
    return values


def assistant_config(name: str) -> Gemma4AssistantConfig:
    """The transformers config of an assistant preset."""
    values = assistant_config_kwargs(name)
    text = Gemma4TextConfig(**values.pop("text_config"))
    return Gemma4AssistantConfig(text_config=text, **values)
