"""Gemma 4 router: scale-free RMSNorm * scale * hidden^-0.5 -> linear -> softmax -> top-k -> renormalize.

The torch reference here is the CPU path and the oracle the fused GPU kernel is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from srt.layers.layernorm import RMSNorm


class RoutingResult(NamedTuple):
    weights: torch.Tensor  # [tokens, top_k] float32, renormalized and times per_expert_scale
    expert_ids: torch.Tensor  # [tokens, top_k] int64


def topk_routing_reference(router_logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> RoutingResult:
    """Top-k of the float32 softmax, renormalized, times the chosen experts' scales (as transformers)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_weights, top_ids = torch.topk(probs, k=top_k, dim=-1)
    top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return RoutingResult(top_weights * per_expert_scale[top_ids].float(), top_ids)


class Router(nn.Module):
    """Parameters keep transformers' names: norm (no weight), proj, scale, per_expert_scale."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.scalar_root_size = hidden_size**-0.5
        self.norm = RMSNorm(hidden_size, eps=eps, with_scale=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, hidden: torch.Tensor) -> RoutingResult:
        logits = self.proj(self.norm(hidden) * self.scale * self.scalar_root_size)
        return topk_routing_reference(logits, self.per_expert_scale, self.top_k)
