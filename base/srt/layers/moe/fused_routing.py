"""Fused top-k routing for the Gemma 4 MoE block: the GPU path of `Router`.

`fused_topk_routing` runs `triton_kernels/routing.py` (one launch per layer, one program per token) where
Triton can run: on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 set before the kernel
was imported, as the tests do). Elsewhere (CPU without the interpreter, no triton installed) it falls back to
`topk_routing_reference`. Both follow the tie rule in `router.py`: lower expert id first among equal logits.
"""

from __future__ import annotations

import torch

from srt.layers.moe.router import RoutingResult, topk_routing_reference
from srt.layers.triton_support import is_interpreted

try:
    from srt.layers.moe.triton_kernels import routing as routing_kernel
except ImportError:  # no triton: the torch reference serves every device
    routing_kernel = None


def triton_runs_on(device: torch.device, kernel: object) -> bool:
    """True when `kernel` (a @triton.jit function) can run on tensors of `device`."""
    return (device.type == "cuda") or (device.type == "cpu" and is_interpreted(kernel))


def fused_topk_routing(router_logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> RoutingResult:
    """weights float32 [T, k] (softmax over the top-k logits, times per_expert_scale[id]) and ids int32 [T, k].

    `router_logits` [T, E] may be float32, bfloat16 or float16; ties resolve lower expert id first.
    """
    if routing_kernel is None or not triton_runs_on(router_logits.device, routing_kernel._topk_routing_kernel):
        weights, ids = topk_routing_reference(router_logits, per_expert_scale, top_k)
        return RoutingResult(weights, ids.to(torch.int32))
    return RoutingResult(*routing_kernel.topk_routing(router_logits, per_expert_scale, top_k))
