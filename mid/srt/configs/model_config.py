"""What srt needs to know about a Gemma 4 text model, read from a transformers config.

Every per-layer value (head_dim, KV-head count, layer type, which layer owns the KV a layer reads) comes from
the checkpoint's config as transformers resolves it; nothing is derived by guessing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, Gemma4TextConfig, Gemma4VisionConfig, PretrainedConfig

from srt.configs import presets

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text")
FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Shape and KV ownership of one attention layer."""

    layer_id: int
    layer_type: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    k_eq_v: bool
    kv_owner: int  # the layer whose K/V buffers this layer reads; itself when it owns KV
    sliding_window: int | None  # tokens a query sees, itself included (HF: kv > q - window)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def owns_kv(self) -> bool:
        return self.kv_owner == self.layer_id


@dataclass(frozen=True)
class ModelConfig:
    """A Gemma 4 text model's structure plus the transformers config it came from."""

    hf_text_config: Gemma4TextConfig
    model_type: str
    layers: tuple[AttentionLayerSpec, ...]
    # the whole `Gemma4Config` of a multimodal checkpoint (token ids of the image markers); None for text-only
    hf_config: PretrainedConfig | None = None
    # tensor parallelism (`for_tensor_parallel`): this rank's share; `layers` then hold its heads only
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def vision_config(self) -> Gemma4VisionConfig | None:
        """The vision tower's config; None for a text-only checkpoint (or one without a vision tower)."""
        return getattr(self.hf_config, "vision_config", None)

    @property
    def image_token_id(self) -> int | None:
        return getattr(self.hf_config, "image_token_id", None)

    @property
    def video_token_id(self) -> int | None:
        """The placeholder of video frames' soft tokens (a frame is an image to the model)."""
        return getattr(self.hf_config, "video_token_id", None)

    @property
    def bidirectional_images(self) -> bool:
        """Whether image tokens attend to each other both ways (sliding layers of 26B-A4B and 31B)."""
        return getattr(self.hf_text_config, "use_bidirectional_attention", None) == "vision"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.hf_text_config.hidden_size

    @property
    def sliding_window(self) -> int:
        return self.hf_text_config.sliding_window

    @property
    def context_len(self) -> int:
        return self.hf_text_config.max_position_embeddings

    @property
    def is_moe(self) -> bool:
        return bool(self.hf_text_config.enable_moe_block and self.hf_text_config.num_experts)

    def tp_part(self, size: int) -> int:
        """This rank's share of a dimension split evenly over the ranks (intermediate sizes, expert widths)."""
        if size % self.tp_size:
            raise ValueError(f"--tp-size {self.tp_size} does not divide a dimension of {size}")
        return size // self.tp_size

    def vocab_part(self, vocab: int) -> int:
        """Rows of a vocab-parallel table per rank: the last rank's share is padded with rows no id selects."""
        return -(-vocab // self.tp_size)

    def for_tensor_parallel(self, rank: int, size: int) -> ModelConfig:
        """This config as rank `rank` of `size` sees it: each layer's query heads split evenly, KV heads split
        where there are at least `size` of them and otherwise one per rank (the head its query heads read,
        held by several ranks). ValueError where the heads do not split."""
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
        layers = tuple(_rank_spec(spec, rank, size) for spec in self.layers)
        return dataclasses.replace(self, layers=layers, tp_rank=rank, tp_size=size)

    @property
    def first_kv_shared_layer(self) -> int | None:
        """Index of the first layer that reads another layer's KV (None without KV sharing)."""
        shared = [spec.layer_id for spec in self.layers if not spec.owns_kv]
        return shared[0] if shared else None

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf_text_config.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelConfig:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: srt serves Gemma 4 checkpoints "
                f"(model_type one of {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        text = config.text_config if model_type == "gemma4" else config
        full = config if model_type == "gemma4" else None
        return cls(hf_text_config=text, model_type=model_type, layers=_layer_specs(text), hf_config=full)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` of a checkpoint directory."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON ({error})") from error
        if model_type not in SUPPORTED_MODEL_TYPES:
            # checked before transformers parses it: a foreign config may fail there with an unrelated error
            raise ValueError(
                f"{config_file}: unsupported model_type {model_type!r}: srt serves Gemma 4 checkpoints "
                f"(model_type one of {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            config = AutoConfig.from_pretrained(str(path))
        except (KeyError, ValueError) as error:
            raise ValueError(f"{config_file}: cannot read config ({error})") from error
        return cls.from_hf_config(config)

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        """A preset as published: text model and vision tower (`--load-format dummy`)."""
        return cls.from_hf_config(presets.preset_config(name))

    @classmethod
    def from_name_or_path(cls, name_or_path: str | Path) -> ModelConfig:
        if presets.is_preset(str(name_or_path)) and not Path(name_or_path).is_dir():
            return cls.from_preset(str(name_or_path))
        return cls.from_pretrained(name_or_path)


def _layer_specs(config: Gemma4TextConfig) -> tuple[AttentionLayerSpec, ...]:
    """Per-layer attention shapes and KV owners, as transformers' Gemma4TextAttention defines them.

    The last `num_kv_shared_layers` layers compute no K/V; each reads the K/V of the last earlier layer of
    the same type (full or sliding).
    """
    num_layers = config.num_hidden_layers
    first_shared = num_layers - (config.num_kv_shared_layers or 0)
    specs = []
    for layer_id, layer_type in enumerate(config.layer_types[:num_layers]):
        per_layer = config.per_layer_config[layer_id]
        owner = layer_id
        if layer_id >= first_shared > 0:
            earlier = config.layer_types[:first_shared]
            owner = len(earlier) - 1 - earlier[::-1].index(layer_type)
        specs.append(
            AttentionLayerSpec(
                layer_id=layer_id,
                layer_type=layer_type,
                head_dim=per_layer.head_dim,
                num_heads=config.num_attention_heads,
                num_kv_heads=per_layer.num_key_value_heads,
                k_eq_v=bool(config.attention_k_eq_v) and layer_type == FULL,
                kv_owner=owner,
                sliding_window=config.sliding_window if layer_type == SLIDING else None,
            )
        )
    return tuple(specs)


def _rank_spec(spec: AttentionLayerSpec, rank: int, size: int) -> AttentionLayerSpec:
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if heads % size:
        raise ValueError(f"--tp-size {size} does not divide the {heads} attention heads of layer {spec.layer_id}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"--tp-size {size} and the {kv_heads} KV heads of layer {spec.layer_id}: one must divide the other"
        )
    return dataclasses.replace(spec, num_heads=heads // size, num_kv_heads=max(1, kv_heads // size))


def kv_heads_of_rank(full_kv_heads: int, rank: int, size: int) -> range:
    """The checkpoint's KV heads that rank `rank` holds: its even share, or with fewer heads than ranks the one
    head its query heads read (query head h reads KV head h // (heads / kv_heads))."""
    if full_kv_heads >= size:
        per_rank = full_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * full_kv_heads // size
    return range(head, head + 1)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on GPU and float32 on CPU (CPU bf16 matmuls are slow and imprecise)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]
