"""Top-k routing kernel: one program per token, the token's whole row of router logits in registers.

    logits row (E values, any float dtype) -> float32
    repeat top_k times:  best = max over experts not yet taken
                         id   = lowest expert id, not yet taken, whose logit == best   (the tie rule)
    weights = softmax over the k chosen logits (float32) * per_expert_scale[id]

Softmax over the top-k logits equals the renormalized top-k of the full softmax (the shared denominator
cancels), so the other E - k exponentials are never computed. "Not yet taken" is a mask, not a -inf
overwrite, so -inf logits are still chosen lowest id first. A NaN logit never equals the maximum; the lowest
untaken id is taken then, so ids always index real experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_routing_kernel(
    logits_ptr,
    scale_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + token * stride_logits + offs_e, mask=offs_e < NUM_EXPERTS, other=0.0).to(tl.float32)
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


def topk_routing(router_logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """(weights float32 [T, k], ids int32 [T, k]) of logits [T, E]; one launch, one program per token."""
    tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _topk_routing_kernel[(tokens,)](
        router_logits,
        per_expert_scale,
        weights,
        ids,
        router_logits.stride(0),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        # a row of 128 logits is 4 per lane of one warp: every reduction stays inside the warp
        num_warps=1 if block_e <= 256 else 4,
    )
    return weights, ids
