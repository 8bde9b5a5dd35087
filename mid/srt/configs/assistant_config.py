"""What srt needs to know about a Gemma 4 MTP assistant (drafter), and whether it fits its target.

Every assistant layer is KV-shared with the *target*: it owns no K/V and reads the buffers of the target's last
KV-owning layer of its own type (sliding or full). srt gives the assistant's layers ids after the target's
(target layers 0 .. N-1, assistant layers N .. N+L-1), so `HybridKVPool` built over both lists resolves an
assistant layer to its target owner exactly as it resolves the target's own KV-shared layers.

The assistant's query sits at the position of the newest token p, which has no KV yet, and reads KV 0 .. p-1.
Its sliding layers see the last window + 1 of those (transformers' assistant mask: a bidirectional window,
flipped), p-W-1 .. p-1; srt's backends bound a window by position (kv > q - window), so that is a window of
W + 2. The target's next query at p reads p-W+1 .. p: a scheduler that drafts keeps two more positions of
sliding-window KV (`DRAFT_EXTRA_SWA_TOKENS`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, Gemma4AssistantConfig

from srt.configs import presets
from srt.configs.model_config import FULL, SLIDING, AttentionLayerSpec, ModelConfig

ASSISTANT_MODEL_TYPE = "gemma4_assistant"
# sliding-window KV positions the drafter reads beyond the target's next query (module docstring)
DRAFT_EXTRA_SWA_TOKENS = 2


@dataclass(frozen=True)
class AssistantConfig:
    """An assistant's transformers config plus its layers mapped onto the target's KV owners."""

    hf_config: Gemma4AssistantConfig
    text: ModelConfig  # the assistant's decoder; layer ids continue the target's, KV owners are target layers

    @property
    def layers(self) -> tuple[AttentionLayerSpec, ...]:
        return self.text.layers

    @property
    def backbone_hidden_size(self) -> int:
        return self.hf_config.backbone_hidden_size

    @property
    def use_centroid_head(self) -> bool:
        """E2B/E4B assistants score only the tokens of the top centroids (`use_ordered_embeddings`)."""
        return bool(self.hf_config.use_ordered_embeddings)

    def for_tensor_parallel(self, rank: int, size: int) -> AssistantConfig:
        """The assistant as rank `rank` of `size` holds it: its query heads split as the target's (so they read
        the target's KV heads of this rank), its MLP width split; its token table (the LM head) whole."""
        return dataclasses.replace(self, text=self.text.for_tensor_parallel(rank, size))

    @classmethod
    def for_target(cls, hf_config: Gemma4AssistantConfig, target: ModelConfig, name: str = "") -> AssistantConfig:
        """Map the assistant's layers onto `target`'s KV owners; one ValueError lists every misfit."""
        text = hf_config.text_config
        problems = []
        if hf_config.backbone_hidden_size != target.hidden_size:
            problems.append(
                f"backbone_hidden_size {hf_config.backbone_hidden_size} != target hidden_size {target.hidden_size}"
            )
        if text.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {text.vocab_size} != target vocab_size {target.vocab_size}")
        if text.num_kv_shared_layers != text.num_hidden_layers:
            problems.append(f"only {text.num_kv_shared_layers} of {text.num_hidden_layers} layers share KV")
        if not hf_config.tie_word_embeddings:
            problems.append("its LM head is not tied to its embeddings (srt supports tied assistants only)")
        owners = _last_kv_owners(target)
        specs = []
        for i, layer_type in enumerate(text.layer_types[: text.num_hidden_layers]):
            per_layer = text.per_layer_config[i]
            owner = owners.get(layer_type)
            if owner is None:
                problems.append(f"layer {i} is {layer_type} but the target has no KV-owning {layer_type} layer")
                continue
            if per_layer.head_dim != owner.head_dim or per_layer.num_key_value_heads != owner.num_kv_heads:
                problems.append(
                    f"layer {i} ({layer_type}) has head_dim {per_layer.head_dim} and "
                    f"{per_layer.num_key_value_heads} KV heads, the target's layer {owner.layer_id} "
                    f"{owner.head_dim} and {owner.num_kv_heads}"
                )
            window = text.sliding_window if layer_type == SLIDING else None
            if window is not None and window > target.sliding_window:
                # the target frees SWA KV older than its own window: a wider assistant window would read freed slots
                problems.append(f"sliding_window {window} > target sliding_window {target.sliding_window}")
            specs.append(
                AttentionLayerSpec(
                    layer_id=target.num_layers + i,
                    layer_type=layer_type,
                    head_dim=owner.head_dim,
                    num_heads=text.num_attention_heads,
                    num_kv_heads=owner.num_kv_heads,
                    k_eq_v=owner.k_eq_v,
                    kv_owner=owner.layer_id,
                    # the last window + 1 KV positions before the query at p (module docstring)
                    sliding_window=None if window is None else window + DRAFT_EXTRA_SWA_TOKENS,
                )
            )
        if problems:
            raise ValueError(f"draft model {name or 'assistant'} does not fit the target model: " + "; ".join(problems))
        return cls(hf_config, ModelConfig(hf_text_config=text, model_type=ASSISTANT_MODEL_TYPE, layers=tuple(specs)))


def _last_kv_owners(target: ModelConfig) -> dict[str, AttentionLayerSpec]:
    """The target's last KV-owning layer of each type: the layers whose KV transformers hands the assistant."""
    owners = {}
    for spec in target.layers:
        if spec.owns_kv and spec.layer_type in (FULL, SLIDING):
            owners[spec.layer_type] = spec
    return owners


def draft_model_type(name_or_path: str) -> str | None:
    """model_type of a draft model (an assistant preset or a checkpoint directory); None when unknown."""
    if presets.is_assistant_preset(name_or_path) and not Path(name_or_path).is_dir():
        return ASSISTANT_MODEL_TYPE
    config_file = Path(name_or_path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text()).get("model_type")
    except json.JSONDecodeError:
        return None


def load_assistant_hf_config(name_or_path: str) -> Gemma4AssistantConfig:
    """The assistant's transformers config from an assistant preset name or a checkpoint directory."""
    model_type = draft_model_type(name_or_path)
    if model_type != ASSISTANT_MODEL_TYPE:
        raise ValueError(
            f"draft model {name_or_path!r} is not a Gemma 4 assistant (model_type {model_type!r}, expected "
            f"{ASSISTANT_MODEL_TYPE!r}; presets: {', '.join(presets.assistant_preset_names())})"
        )
    if presets.is_assistant_preset(name_or_path) and not Path(name_or_path).is_dir():
        return presets.assistant_config(name_or_path)
    return AutoConfig.from_pretrained(name_or_path)
