"""Gemma 4 router: scale-free RMSNorm * scale * hidden^-0.5 -> linear -> softmax -> top-k -> renormalize.

`topk_routing_reference` is the CPU path and the oracle the fused GPU kernel (`fused_routing.py`) is tested
against. Tie rule, shared by both: experts are ranked by their float32 logit, highest first, and among equal
logits the lower expert id comes first. (transformers ranks softmax probabilities with `torch.topk`, whose
order among equal values is unspecified; on inputs whose probabilities have no ties both rules pick the same
experts, in the same order, with bit-identical weights.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from srt.layers.layernorm import RMSNorm


class RoutingResult(NamedTuple):
    weights: torch.Tensor  # [tokens, top_k] float32, renormalized and times per_expert_scale
    expert_ids: torch.Tensor  # [tokens, top_k] int64 (reference) or int32 (fused kernel)


def topk_routing_reference(router_logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> RoutingResult:
    """Top-k of the float32 softmax, renormalized, times the chosen experts' scales (as transformers).

    Experts are chosen by a stable descending sort of the float32 logits: ties go to the lower expert id.
    """
    logits = router_logits.float() + 0.0  # -0.0 -> +0.0: the sort must see them as the equal values they are
    probs = torch.softmax(logits, dim=-1)
    top_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :top_k]
    top_weights = probs.gather(-1, top_ids)
    top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return RoutingResult(top_weights * per_expert_scale[top_ids].float(), top_ids)


class Router(nn.Module):
    """Parameters keep transformers' names: norm (no weight), proj, scale, per_expert_scale.

    `backend`: "auto" runs the fused Triton routing kernel on CUDA and the torch reference elsewhere;
    "torch" always runs the reference (tests compare the two on one GPU).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.backend = "auto"
        self.scalar_root_size = hidden_size**-0.5
        self.norm = RMSNorm(hidden_size, eps=eps, with_scale=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, hidden: torch.Tensor) -> RoutingResult:
        logits = self.proj(self.norm(hidden) * self.scale * self.scalar_root_size)
        if self.backend == "auto" and logits.is_cuda:
            from srt.layers.moe.fused_routing import fused_topk_routing

            return fused_topk_routing(logits, self.per_expert_scale, self.top_k)
        return topk_routing_reference(logits, self.per_expert_scale, self.top_k)
