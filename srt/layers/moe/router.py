"""Gemma 4 router: scale-free RMSNorm * scale * hidden^-0.5 -> linear -> softmax -> top-k -> renormalize.

The top-k step is `kernels/moe/routing.py` (one Triton launch on GPU; its torch reference elsewhere, with the
same tie rule: lower expert id first among equal logits). At decode sizes on Hopper the projection is a chained
Triton GEMM in K-chunks (`kernels/decode_gemm.py`, `ROUTER_TILES`) whose float32 partials the top-k kernel sums:
cuBLAS ran it split-K as a GEMM and a reduction, two launches that wait for the kernel ahead to finish.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.kernels.decode_gemm import ROUTER_TILES, decode_gemm_applies, decode_linear
from srt.kernels.moe.routing import RoutingResult, topk_routing
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import store_transposed


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
        return self.route(self.norm(hidden) * self.scale * self.scalar_root_size)

    def route(self, router_input: torch.Tensor) -> RoutingResult:
        """The routing of `router_input`, the normed and scaled hidden states (the decoder layer computes them in
        its residual add's kernel: `norm.add_rms_norm_then_moe_norms`)."""
        use_triton = False if self.backend == "torch" else None
        weight = self.proj.weight
        splits = max(1, weight.shape[1] // ROUTER_TILES.block_k)  # a narrower hidden size fails the tiles' check
        if use_triton is None and decode_gemm_applies(router_input, weight, splits, ROUTER_TILES):
            partials = decode_linear(router_input, weight, splits, ROUTER_TILES)
            return topk_routing(partials, self.per_expert_scale, self.top_k, logits_dtype=router_input.dtype)
        return topk_routing(self.proj(router_input), self.per_expert_scale, self.top_k, use_triton)

    def fuse_projections(self) -> None:
        """The projection's weight stored transposed, the layout the chained decode GEMM reads (`route`)."""
        store_transposed(self.proj)

    def input_norms(self) -> tuple[torch.Tensor, float]:
        """(scale, scalar) that multiply the scale-free norm of the hidden states, in that order."""
        return self.scale, self.scalar_root_size
