"""Top-k routing kernel: one program per token, the token's whole row of router logits in registers.

    logits row (E values, any float dtype) -> float32
    repeat top_k times:  best = max over experts not yet taken
                         id   = lowest expert id, not yet taken, whose logit == best   (the tie rule)
    weights = softmax over the k chosen logits (float32) * per_expert_scale[id]

Softmax over the top-k logits equals the renormalized top-k of the full softmax (the shared denominator
cancels), so the other E - k exponentials are never computed. "Not yet taken" is a mask, not a -inf
overwrite, so -inf logits are still chosen lowest id first. A NaN logit never equals the maximum; the lowest
untaken id is taken then, so ids always index real experts.

The logits may come as float32 partial sums over K-chunks ([splits, T, E], `kernels/decode_gemm.py`, the router
projection at decode sizes): the kernel sums them and rounds the sum to the projection's dtype, as the unchunked
product would have been rounded, before anything else.

`topk_routing_reference` is the torch math (the CPU path and the oracle). Tie rule, shared by both: experts
are ranked by their float32 logit, highest first, and among equal logits the lower expert id comes first.
(transformers ranks softmax probabilities with `torch.topk`, whose order among equal values is unspecified;
on inputs whose probabilities have no ties both rules pick the same experts, in the same order, with
bit-identical weights.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.kernels.norm import sum_partials
from srt.kernels.triton_support import jit, last_dim_contiguous, round_to, runs_triton, tl, triton


@jit
def _topk_routing_kernel(
    logits_ptr,
    scale_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    stride_split,
    NUM_EXPERTS: tl.constexpr,
    SPLITS: tl.constexpr,
    LOGITS_DTYPE: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    row = logits_ptr + token * stride_logits + offs_e
    x = tl.load(row, mask=offs_e < NUM_EXPERTS, other=0.0).to(tl.float32)
    if SPLITS > 1:  # partial sums over K-chunks: their sum, rounded as the whole product would have been
        for split in tl.static_range(1, SPLITS):
            x += tl.load(row + split * stride_split, mask=offs_e < NUM_EXPERTS, other=0.0)
        x = round_to(x, LOGITS_DTYPE)
    taken = offs_e >= NUM_EXPERTS  # padding lanes never win
    offs_k = tl.arange(0, BLOCK_K)
    top_logits = tl.full([BLOCK_K], float("-inf"), tl.float32)
    top_ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        candidates = tl.where(taken, float("-inf"), x)
        best = tl.max(candidates, axis=0)
        best_id = tl.min(tl.where((candidates == best) & ~taken, offs_e, BLOCK_E), axis=0)
        first_free = tl.min(tl.where(taken, BLOCK_E, offs_e), axis=0)
        best_id = tl.where(best_id == BLOCK_E, first_free, best_id)  # only when best is NaN
        taken = taken | (offs_e == best_id)
        top_logits = tl.where(offs_k == j, best, top_logits)
        top_ids = tl.where(offs_k == j, best_id, top_ids)
    in_k = offs_k < TOP_K
    shifted = top_logits - tl.max(top_logits, axis=0)
    e = tl.where(in_k, tl.exp(shifted), 0.0)
    scale = tl.load(scale_ptr + top_ids, mask=in_k, other=0.0).to(tl.float32)
    weights = e / tl.sum(e, axis=0) * scale
    tl.store(weights_ptr + token * TOP_K + offs_k, weights, mask=in_k)
    tl.store(ids_ptr + token * TOP_K + offs_k, top_ids, mask=in_k)


class RoutingResult(NamedTuple):
    weights: torch.Tensor  # [tokens, top_k] float32, renormalized and times per_expert_scale
    expert_ids: torch.Tensor  # [tokens, top_k] int32


def topk_routing_reference(router_logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> RoutingResult:
    """Top-k of the float32 softmax, renormalized, times the chosen experts' scales (as transformers).

    Experts are chosen by a stable descending sort of the float32 logits: ties go to the lower expert id.
    """
    logits = router_logits.float() + 0.0  # -0.0 -> +0.0: the sort must see them as the equal values they are
    probs = torch.softmax(logits, dim=-1)
    top_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :top_k]
    top_weights = probs.gather(-1, top_ids)
    top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return RoutingResult(top_weights * per_expert_scale[top_ids].float(), top_ids.to(torch.int32))


def topk_routing(
    router_logits: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    use_triton: bool | None = None,
    logits_dtype: torch.dtype | None = None,
) -> RoutingResult:
    """(weights float32 [T, k], ids int32 [T, k]) of logits [T, E] (float32, bfloat16 or float16), or of float32
    partial sums [splits, T, E] whose sum rounded to `logits_dtype` is the logits; one launch, one program per
    token. `use_triton` as in kernels/norm.py."""
    if router_logits.dim() == 3:
        if logits_dtype is None:
            raise ValueError("topk_routing: partial sums [splits, T, E] need logits_dtype")
        if not runs_triton(router_logits.device, use_triton, _topk_routing_kernel):
            return topk_routing_reference(sum_partials(router_logits, logits_dtype), per_expert_scale, top_k)
    elif not runs_triton(router_logits.device, use_triton, _topk_routing_kernel):
        return topk_routing_reference(router_logits, per_expert_scale, top_k)
    splits = router_logits.shape[0] if router_logits.dim() == 3 else 1
    router_logits = router_logits.contiguous() if splits > 1 else last_dim_contiguous(router_logits)
    tokens, num_experts = router_logits.shape[-2:]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return RoutingResult(weights, ids)
    block_e = triton.next_power_of_2(num_experts)
    _topk_routing_kernel[(tokens,)](
        router_logits,
        per_expert_scale,
        weights,
        ids,
        router_logits.stride(-2),
        router_logits.stride(0) if splits > 1 else 0,
        NUM_EXPERTS=num_experts,
        SPLITS=splits,
        LOGITS_DTYPE=getattr(tl, str(logits_dtype or router_logits.dtype).removeprefix("torch.")),
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        # a row of 128 logits is 4 per lane of one warp: every reduction stays inside the warp
        num_warps=1 if block_e <= 256 else 4,
    )
    return RoutingResult(weights, ids)
