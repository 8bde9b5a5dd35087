"""The expert MLPs of a Gemma 4 MoE layer, stored as 3-D tensors with transformers' names.

`forward` runs the fused experts of `fused_experts.py` on CUDA; `forward_reference` is the torch reference:
a loop over the experts that received tokens. It is the CPU path and the test oracle of the fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.moe.fused_experts import fused_experts


class Experts(nn.Module):
    """gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden, inter]; gelu-tanh gating.

    `backend`: "auto" runs the fused experts on CUDA and the torch loop elsewhere; "torch" always runs the
    loop; "triton" or "grouped_mm" force that fused backend.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.backend = "auto"
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch" or (self.backend == "auto" and not hidden.is_cuda):
            return self.forward_reference(hidden, weights, expert_ids)
        backend = None if self.backend == "auto" else self.backend
        return fused_experts(hidden, self.gate_up_proj, self.down_proj, weights, expert_ids, backend)

    def forward_reference(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The torch loop over the experts that received tokens (reads their ids back to the host)."""
        out = torch.zeros_like(hidden)
        for expert in torch.unique(expert_ids).tolist():
            token_idx, slot = torch.where(expert_ids == expert)
            gate, up = F.linear(hidden[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out.index_add_(0, token_idx, (expert_out * weights[token_idx, slot, None]).to(out.dtype))
        return out
