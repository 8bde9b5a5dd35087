"""kernels/moe/routing.py: the top-k routing kernel against its reference, and the reference against transformers.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set in conftest.py before
anything imports triton) at small token counts; with CUDA the `gpu` tests run 1..8192 tokens at 26B-A4B's routing
shape (128 experts, top 8). Every case: ids equal, weights within 1e-6 (the kernel's softmax over the top-k
logits and the reference's renormalized full softmax differ by float32 rounding only). Inputs include ties
(the rule: lower expert id first among equal logits), -inf and huge logits, and all three float dtypes.
"""

from __future__ import annotations

import pytest
import torch

from srt.kernels.moe.routing import topk_routing, topk_routing_reference
from srt.kernels.norm import sum_partials
from srt.layers.moe.router import Router

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXPERTS, TOP_K = 128, 8  # gemma-4-26B-A4B
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WEIGHT_TOL = 1e-6


def expert_scales(num_experts: int = EXPERTS, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (0.5 + torch.rand(num_experts, generator=generator)).to(DEVICE)


def assert_matches_reference(logits: torch.Tensor, scales: torch.Tensor, top_k: int = TOP_K) -> None:
    weights, ids = topk_routing(logits, scales, top_k, use_triton=True)
    expected_weights, expected_ids = topk_routing_reference(logits, scales, top_k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=WEIGHT_TOL, rtol=0, equal_nan=True)


def random_logits(tokens: int, dtype: torch.dtype, std: float = 1.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (std * torch.randn(tokens, EXPERTS, generator=generator)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_random_logits_match_reference(tokens: int, dtype: torch.dtype) -> None:
    assert_matches_reference(random_logits(tokens, dtype, seed=tokens), expert_scales())


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lower_expert_id(dtype: torch.dtype) -> None:
    # logits in {-2..2}: ~25 experts share each value, so ties cross the top-k boundary in every row
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-2, 3, (6, EXPERTS), generator=generator).to(dtype).to(DEVICE)
    assert_matches_reference(logits, expert_scales())
    weights, ids = topk_routing(logits, expert_scales(), TOP_K, use_triton=True)
    for row, chosen in zip(logits.float().cpu(), ids.cpu().tolist(), strict=True):
        top = float(row.max())
        expected = [i for i in range(EXPERTS) if float(row[i]) == top][:TOP_K]
        assert chosen[: len(expected)] == expected  # the first tied group in id order


def test_all_equal_logits_pick_the_first_k_experts_with_equal_weights() -> None:
    scales = expert_scales()
    weights, ids = topk_routing(torch.full((2, EXPERTS), 0.25, device=DEVICE), scales, TOP_K, use_triton=True)
    assert ids.tolist() == [list(range(TOP_K))] * 2
    torch.testing.assert_close(weights, (scales[:TOP_K] / TOP_K).expand(2, TOP_K), atol=WEIGHT_TOL, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    rows = torch.randn(7, EXPERTS, generator=torch.Generator().manual_seed(5)).to(dtype)
    rows[0] *= 1e4 if dtype != torch.float16 else 1e3  # exp underflows to 0 for all but the top few
    rows[1, ::2] = -big  # half the experts at the most negative finite logit
    rows[2] = float("-inf")  # k-1 finite experts, then the -inf ones lowest id first
    rows[2, 40 : 40 + TOP_K - 1] = torch.arange(TOP_K - 1, dtype=dtype)
    rows[3, 7] = big  # one finite maximum far above the rest: weight 1 at rank 0, 0 for the others
    rows[4, 5:9] = big / 2  # a 4-way tie at a huge logit
    rows[5] = torch.linspace(-1e-3, 1e-3, EXPERTS).to(dtype)  # tiny logits, near-uniform weights
    rows[6] = 0.0
    rows[6, ::3] = -0.0  # -0.0 == +0.0: one tie, lowest id first
    assert_matches_reference(rows.to(DEVICE), expert_scales())


def test_strided_logits_and_other_shapes() -> None:
    wide = random_logits(4, torch.float32, seed=9)
    assert_matches_reference(wide[:, :64], expert_scales(64))  # row stride 128, 64 experts
    assert_matches_reference(wide[:, :96].contiguous(), expert_scales(96), top_k=3)  # padded to 128 lanes
    assert_matches_reference(wide[:, :16].contiguous(), expert_scales(16), top_k=4)  # the tiny preset's shape


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float16])
def test_partial_sums_are_summed_then_rounded(logits_dtype: torch.dtype) -> None:
    """[splits, T, E] float32 partials (the router's chained decode GEMM): the kernel routes their sum rounded to
    the projection's dtype, ties included (partials whose sums land on few values)."""
    generator = torch.Generator().manual_seed(17)
    partials = torch.randn(11, 5, EXPERTS, generator=generator).to(DEVICE)
    tied = torch.randint(-2, 3, (11, 3, EXPERTS), generator=generator).float().to(DEVICE) / 4
    for parts in (partials, tied):
        weights, ids = topk_routing(parts, expert_scales(), TOP_K, use_triton=True, logits_dtype=logits_dtype)
        logits = sum_partials(parts, logits_dtype)
        expected_weights, expected_ids = topk_routing_reference(logits, expert_scales(), TOP_K)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, atol=WEIGHT_TOL, rtol=0)
        reference = topk_routing(parts, expert_scales(), TOP_K, use_triton=False, logits_dtype=logits_dtype)
        assert torch.equal(reference.expert_ids, expected_ids) and torch.equal(reference.weights, expected_weights)
    with pytest.raises(ValueError, match="logits_dtype"):
        topk_routing(partials, expert_scales(), TOP_K)


def test_no_tokens() -> None:
    weights, ids = topk_routing(torch.empty(0, EXPERTS, device=DEVICE), expert_scales(), TOP_K, use_triton=True)
    assert weights.shape == ids.shape == (0, TOP_K)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU default is the torch reference")
def test_cpu_default_is_the_reference() -> None:
    logits = random_logits(3, torch.bfloat16, seed=11)
    weights, ids = topk_routing(logits, expert_scales(), TOP_K)
    expected_weights, expected_ids = topk_routing_reference(logits, expert_scales(), TOP_K)
    assert ids.dtype == expected_ids.dtype == torch.int32 and torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights)


def test_reference_equals_transformers_router_on_tie_free_inputs() -> None:
    """Same parameters, same hidden states: transformers' Gemma4TextRouter and srt's Router (CPU) agree
    exactly (ids, and weights bit for bit)."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    config = Gemma4TextConfig(hidden_size=64, num_experts=EXPERTS, top_k_experts=TOP_K, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    theirs = Gemma4TextRouter(config).eval()
    with torch.no_grad():
        theirs.proj.weight.normal_(0, 1.0)
        theirs.scale.uniform_(0.5, 1.5)
        theirs.per_expert_scale.uniform_(0.5, 1.5)
    ours = Router(64, EXPERTS, TOP_K, 1e-6)
    ours.load_state_dict(theirs.state_dict())
    hidden = torch.randn(64, 64)
    with torch.no_grad():
        _, their_weights, their_ids = theirs(hidden)
        our_weights, our_ids = ours(hidden)
    assert torch.equal(our_ids.long(), their_ids)
    assert torch.equal(our_weights, their_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 31, 32, 100, 512, 1000, 4096, 8192])
def test_gpu_token_counts_match_reference(tokens: int, dtype: torch.dtype) -> None:
    assert_matches_reference(random_logits(tokens, dtype, std=2.0, seed=tokens), expert_scales())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_ties_at_8192_tokens(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(13)
    assert_matches_reference(
        torch.randint(-3, 4, (8192, EXPERTS), generator=generator).to(dtype).to(DEVICE), expert_scales()
    )


@pytest.mark.gpu
def test_gpu_router_runs_the_fused_kernel() -> None:
    router = Router(256, EXPERTS, TOP_K, 1e-6).to(DEVICE)
    with torch.no_grad():
        router.proj.weight.normal_()
        hidden = torch.randn(17, 256, device=DEVICE)
        weights, ids = router(hidden)
        logits = router.proj(router.norm(hidden) * router.scale * router.scalar_root_size)
        fused = topk_routing(logits, router.per_expert_scale, TOP_K, use_triton=True)
        router.backend = "torch"
        expected_weights, expected_ids = router(hidden)
    assert torch.equal(ids, fused.expert_ids) and torch.equal(weights, fused.weights)  # the kernel ran
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=WEIGHT_TOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 33])
def test_gpu_router_at_decode_sizes_runs_the_chained_gemm(tokens: int) -> None:
    """26B-A4B's router shape: <= 32 rows take the K-chunked Triton GEMM whose partials the top-k kernel sums;
    its logits are the cuBLAS product's up to float32 summation order, so the routing is the same on these
    tie-free inputs (33 rows take cuBLAS: the same path as the reference)."""
    router = Router(2816, EXPERTS, TOP_K, 1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        router.proj.weight.normal_(0, 0.05)
        router.per_expert_scale.uniform_(0.5, 1.5)
        router.fuse_projections()
        router_input = torch.randn(tokens, 2816, device=DEVICE, dtype=torch.bfloat16)
        weights, ids = router.route(router_input)
        router.backend = "torch"
        expected_weights, expected_ids = router.route(router_input)
    assert router.proj.weight.t().is_contiguous()
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-2, rtol=0)  # one bf16 ulp of a logit at most
