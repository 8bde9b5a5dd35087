"""Gemma 4's vision tower and image embedder (`model.vision_tower`, `model.embed_vision` in the checkpoint).

Numerically it follows transformers' Gemma4VisionModel and Gemma4MultimodalEmbedder; what differs is the input
layout. transformers pads every image to the processor's patch budget and masks the padding. srt receives each
image's real patches only (`multimodal/inputs.ImageItem`), and the encoder (`multimodal/encoder.py`) stacks
images with the same patch count into one batch, so no call carries padding and attention needs no mask:

    patches [B, n, 3*16*16] -> 2 * (x - 0.5) @ input_proj + pos_x + pos_y
        -> encoder layers (bidirectional attention, 2-D RoPE: x on the first half of each head, y on the second)
        -> 3x3 average pool by patch position (float32) * sqrt(hidden) -> standardize (26B / 31B)
    embed_vision: scale-free RMSNorm -> projection to the text model's hidden size
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma4VisionConfig

from srt.layers.layernorm import RMSNorm


class ClippableLinear(nn.Module):
    """A bias-free linear layer whose input and output are clamped to ranges stored in the checkpoint (E2B, E4B)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "output_min"):
                self.register_buffer(name, torch.tensor(-float("inf")))
            for name in ("input_max", "output_max"):
                self.register_buffer(name, torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class AxialRope(nn.Module):
    """2-D RoPE: the first half of each head rotates by the patch's x position, the second half by its y."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.theta = config.rope_parameters["rope_theta"]
        self.half = config.head_dim // 2

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n, head_dim] cos and sin for [B, n, 2] (x, y) patch positions."""
        # computed per call, not a buffer: the model is materialised from the meta device with empty buffers
        exponents = torch.arange(0, self.half, 2, dtype=torch.float, device=positions.device) / self.half
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = positions[..., None].float() * inv_freq  # [B, n, 2, head_dim / 4]
        x_freqs, y_freqs = freqs[..., 0, :], freqs[..., 1, :]
        angles = torch.cat([x_freqs, x_freqs, y_freqs, y_freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, heads, head_dim]; each half is rotated as a standard rotate-half RoPE of its own."""
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        parts = []
        for x_part, cos_part, sin_part in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True):
            parts.append(x_part * cos_part + rotate_half(x_part) * sin_part)
        return torch.cat(parts, dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        heads, kv_heads, head_dim, hidden = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        clipped = config.use_clipped_linears
        self.head_dim = head_dim
        self.q_proj = ClippableLinear(hidden, heads * head_dim, clipped)
        self.k_proj = ClippableLinear(hidden, kv_heads * head_dim, clipped)
        self.v_proj = ClippableLinear(hidden, kv_heads * head_dim, clipped)
        self.o_proj = ClippableLinear(heads * head_dim, hidden, clipped)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.v_norm = RMSNorm(head_dim, config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, n, _ = x.shape
        q = AxialRope.apply(self.q_norm(self.q_proj(x).view(batch, n, -1, self.head_dim)), cos, sin)
        k = AxialRope.apply(self.k_norm(self.k_proj(x).view(batch, n, -1, self.head_dim)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(batch, n, -1, self.head_dim))
        # every patch of an image sees every other one; a batch holds whole images of one size, so no mask
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        clipped = config.use_clipped_linears
        self.gate_proj = ClippableLinear(config.hidden_size, config.intermediate_size, clipped)
        self.up_proj = ClippableLinear(config.hidden_size, config.intermediate_size, clipped)
        self.down_proj = ClippableLinear(config.intermediate_size, config.hidden_size, clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.rotary_emb = AxialRope(config)
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class PatchEmbedder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.empty(2, config.position_embedding_size, config.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Gemma 4 maps pixels from [0, 1] to [-1, 1] here rather than in the processor
        hidden = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return hidden + F.embedding(positions[..., 0], table[0]) + F.embedding(positions[..., 1], table[1])


class Gemma4VisionTower(nn.Module):
    """Patches of same-size images -> their soft tokens (before `embed_vision`). Parameter prefix `vision_tower.`."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.pool = config.pooling_kernel_size
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        if config.standardize:
            self.register_buffer("std_bias", torch.zeros(config.hidden_size))
            self.register_buffer("std_scale", torch.ones(config.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches [B, n, 3*p*p] in [0, 1], positions [B, n, 2] (x, y), no padding -> [B, n / k^2, hidden] float32.

        Each output token averages a k x k block of patches (k = pooling_kernel_size), in row-major block order,
        as transformers' pooler orders them."""
        hidden = self.encoder(self.patch_embedder(patches, positions), positions)
        pooled = self._pool(hidden, positions) * self.config.hidden_size**0.5
        if self.config.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled

    def _pool(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Average of each k x k block of patches, in float32; blocks numbered x // k + (width // k) * (y // k)."""
        batch, n, dim = hidden.shape
        k = self.pool
        blocks_per_row = torch.div(positions[..., 0].amax(dim=1, keepdim=True) + 1, k, rounding_mode="floor")
        block = torch.div(positions[..., 0], k, rounding_mode="floor")
        block = block + blocks_per_row * torch.div(positions[..., 1], k, rounding_mode="floor")
        per_image = n // (k * k)
        flat = (block + torch.arange(batch, device=hidden.device)[:, None] * per_image).reshape(-1)
        sums = torch.zeros(batch * per_image, dim, dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, flat, hidden.reshape(-1, dim).float())
        return (sums / (k * k)).view(batch, per_image, dim)


class Gemma4VisionEmbedder(nn.Module):
    """Soft tokens -> the text model's embedding space (`embed_vision.`): scale-free RMSNorm, then a projection."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(vision_hidden, eps, with_scale=False)
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)

    def forward(self, soft_tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(soft_tokens))
