"""Mapping checkpoint tensor names to srt's parameter names.

srt keeps Hugging Face names. Multimodal `gemma4` checkpoints nest the text model under
`model.language_model.`; their vision tower and image embedder load into `vision_tower.` and `embed_vision.`
of `Gemma4ForConditionalGeneration` (when the model has them); audio is not supported yet and is skipped.
"""

from __future__ import annotations

import re

from srt.configs.model_config import ModelConfig

_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
_SHARED_KV_WEIGHT = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def to_param_name(checkpoint_name: str, config: ModelConfig) -> str | None:
    """The parameter a checkpoint tensor loads into, or None for tensors the model does not use."""
    if checkpoint_name.startswith(AUDIO_PREFIXES):
        return None
    if checkpoint_name.startswith(_VISION_PREFIXES):
        return checkpoint_name.removeprefix("model.") if config.vision_config is not None else None
    name = checkpoint_name
    if name.startswith(_MULTIMODAL_TEXT_PREFIX):
        name = "model." + name[len(_MULTIMODAL_TEXT_PREFIX) :]
    match = _SHARED_KV_WEIGHT.match(name)
    if match and not config.layers[int(match.group(1))].owns_kv:
        return None  # some exports keep K/V weights of KV-shared layers; those layers never use them
    if name == "lm_head.weight" and config.hf_text_config.tie_word_embeddings:
        return None
    return name
