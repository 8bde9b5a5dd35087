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

from transformers import Gemma4TextConfig

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
    return Gemma4TextConfig(**preset_text_kwargs(name))
