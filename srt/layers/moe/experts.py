"""The expert MLPs of a Gemma 4 MoE layer, stored as 3-D tensors with transformers' names.

`forward` runs the fused experts of `fused_experts.py` on CUDA; `forward_reference` is the torch reference:
a loop over the experts that received tokens. It is the CPU path and the test oracle of the fused kernels.

FP8 experts (#26): `quantize_fp8()` replaces both weights in place by float8_e4m3fn ones with a float32 scale
per output channel (gate_up_proj_scale [experts, 2 * inter], down_proj_scale [experts, hidden]); weights are
`q * scale[..., None]`. At decode sizes only the weights are quantized: activations stay in the model dtype,
the kernels upcast each FP8 tile and multiply the accumulator by the column scales, and `forward_reference`
dequantizes the experts it runs and then multiplies (the same math, the oracle of the kernels). At prefill
sizes on FP8 tensor cores the fused path quantizes the activations per token too (W8A8, `fused_experts.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.moe.fused_experts import fused_experts
from srt.model_loader.fp8 import FP8, Fp8Scheme, dequantize, quantize

PER_CHANNEL = Fp8Scheme("channel")


class Experts(nn.Module):
    """gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden, inter]; gelu-tanh gating.

    `backend`: "auto" runs the fused experts on CUDA and the torch loop elsewhere; "torch" always runs the
    loop; "triton" or "grouped_mm" force that fused backend (grouped_mm runs 16-bit weights only).
    """

    gate_up_proj_scale: torch.Tensor | None
    down_proj_scale: torch.Tensor | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.backend = "auto"
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # None (and out of the state dict) until quantize_fp8()
        self.register_buffer("gate_up_proj_scale", None)
        self.register_buffer("down_proj_scale", None)

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_proj.dtype == FP8

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Replace the 16-bit (or float32) expert weights by float8_e4m3fn ones and per-output-channel float32
        scales (absmax / 448, `model_loader/fp8.py`), on the weights' device. One expert at a time goes through
        float32, so the extra memory is one expert's, not a layer's; the old weights are freed on return (on
        CUDA into torch's cache: `torch.cuda.empty_cache()` once after the last layer hands them back before
        the KV pools are allocated). Call it after loading and before CUDA graphs are captured (they hold the
        weights' addresses), and last: a later `module.to(dtype)` would cast the FP8 weights and scales too."""
        if self.is_fp8:
            return
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):
                q[expert], expert_scale = quantize(weight[expert], PER_CHANNEL)
                scale[expert] = expert_scale.squeeze(1)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", scale)

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2 * inter, hidden], down [hidden, inter]) of one expert in `dtype`, dequantized if FP8."""
        if not self.is_fp8:
            return self.gate_up_proj[expert].to(dtype), self.down_proj[expert].to(dtype)
        return (
            dequantize(self.gate_up_proj[expert], self.gate_up_proj_scale[expert], PER_CHANNEL, dtype),
            dequantize(self.down_proj[expert], self.down_proj_scale[expert], PER_CHANNEL, dtype),
        )

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, combine: bool = True
    ) -> torch.Tensor:
        """[tokens, hidden]; with `combine` False, [tokens, P, hidden] terms whose sum over P it is (the top_k slot
        outputs of the fused backends, the sum itself as P = 1 from the torch loop)."""
        if self.backend == "torch" or (self.backend == "auto" and not hidden.is_cuda):
            out = self.forward_reference(hidden, weights, expert_ids)
            return out if combine else out.unsqueeze(1)
        backend = None if self.backend == "auto" else self.backend
        return fused_experts(
            hidden,
            self.gate_up_proj,
            self.down_proj,
            weights,
            expert_ids,
            backend,
            gate_up_scale=self.gate_up_proj_scale,
            down_scale=self.down_proj_scale,
            combine=combine,
        )

    def forward_reference(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The torch loop over the experts that received tokens (reads their ids back to the host). FP8 experts
        are dequantized into the activations' dtype first (weight-only quantization)."""
        out = torch.zeros_like(hidden)
        for expert in torch.unique(expert_ids).tolist():
            token_idx, slot = torch.where(expert_ids == expert)
            gate_up_proj, down_proj = self.expert_weights(expert, hidden.dtype)
            gate, up = F.linear(hidden[token_idx], gate_up_proj).chunk(2, dim=-1)
            expert_out = F.linear(F.gelu(gate, approximate="tanh") * up, down_proj)
            out.index_add_(0, token_idx, (expert_out * weights[token_idx, slot, None]).to(out.dtype))
        return out


def quantize_experts_fp8(model: nn.Module) -> int:
    """`quantize_fp8()` every `Experts` of `model` (a load-time hook's one call), then give the freed 16-bit
    weights back to the device; returns how many were quantized."""
    experts = [module for module in model.modules() if isinstance(module, Experts)]
    for module in experts:
        module.quantize_fp8()
    if torch.cuda.is_available() and any(module.gate_up_proj.is_cuda for module in experts):
        torch.cuda.empty_cache()
    return len(experts)
