"""Mapping checkpoint tensor names to srt's parameter names.

srt keeps Hugging Face names. Multimodal `gemma4` checkpoints nest the text model under
`model.language_model.`; their vision/audio towers are not part of the text model.
"""

from __future__ import annotations

import re

from srt.configs.model_config import ModelConfig

_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_NON_TEXT_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
_SHARED_KV_WEIGHT = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def to_param_name(checkpoint_name: str, config: ModelConfig) -> str | None:
    """The parameter a checkpoint tensor loads into, or None for tensors the text model does not use."""
    if checkpoint_name.startswith(_NON_TEXT_PREFIXES):
        return None
    name = checkpoint_name
    if name.startswith(_MULTIMODAL_TEXT_PREFIX):
        name = "model." + name[len(_MULTIMODAL_TEXT_PREFIX) :]
    match = _SHARED_KV_WEIGHT.match(name)
    if match and not config.layers[int(match.group(1))].owns_kv:
        return None  # some exports keep K/V weights of KV-shared layers; those layers never use them
    if name == "lm_head.weight" and config.hf_text_config.tie_word_embeddings:
        return None
    return name
