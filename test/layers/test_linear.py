"""layers/linear.py: the projection seam (K-split partial sums at decode sizes, the plain product elsewhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.decode_gemm import decode_gemm_applies
from srt.kernels.norm import sum_partials
from srt.layers.linear import TRITON_SPLITS, linear_partials, stack_linears, store_transposed


def test_linear_partials_off_cuda_is_the_plain_product() -> None:
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    assert torch.equal(linear_partials(x, weight.t().contiguous().t()), F.linear(x, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_linear_partials_on_gpu_sum_to_the_product(rows: int) -> None:
    x = torch.randn(rows, 10240, device="cuda").bfloat16()
    weight = (torch.randn(10240, 2560, device="cuda") / 100).bfloat16().t()  # stored transposed, as the model's
    expected = F.linear(x, weight).float()
    for splits in (None, 2):  # srt's choice (the chained Triton GEMM on Hopper), and cuBLAS's batched GEMM
        partials = linear_partials(x, weight, splits)
        chunks = TRITON_SPLITS if splits is None and decode_gemm_applies(x, weight, TRITON_SPLITS) else 2
        assert partials.shape == (chunks, rows, 2560) and partials.dtype == torch.float32
        error = (sum_partials(partials, torch.bfloat16).float() - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, error  # within a bf16 rounding step of the largest output


def test_stacked_and_transposed_weights_give_the_same_products() -> None:
    torch.manual_seed(0)
    q, k = nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)
    x = torch.randn(3, 64)
    stacked = stack_linears(q, k)
    assert stacked.weight.t().is_contiguous() and stacked.weight.shape == (48, 64)
    # the same dot products; BLAS may block them differently, so not bit-for-bit
    torch.testing.assert_close(stacked(x), torch.cat([q(x), k(x)], dim=-1), rtol=1e-6, atol=1e-6)
    expected, expected_weight = q(x), q.weight.detach().clone()
    store_transposed(q)
    assert q.weight.t().is_contiguous() and torch.equal(q.weight, expected_weight)
    torch.testing.assert_close(q(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_fp8_projections_through_the_seam_on_gpu(strategy: str) -> None:
    """E4B's down and gate_up as Fp8Linears: the chained FP8 GEMM's partial sums and gelu * up at decode sizes,
    the FP8 prefill GEMM's plain product above them. Bounds against the dequantized weights: 1e-2 for the
    decode sizes' weight-only kernels; the prefill GEMM quantizes x too (W8A8), a few percent."""
    from srt.kernels.decode_gemm import GATED
    from srt.kernels.decode_gemm_fp8 import decode_fp8_applies
    from srt.kernels.gelu_mul import gelu_tanh_mul_packed
    from srt.layers.fp8_linear import Fp8Linear
    from srt.layers.linear import gelu_mlp
    from srt.model_loader.fp8 import Fp8Scheme, quantize

    def fp8(n: int, k: int) -> Fp8Linear:
        q, scale = quantize(torch.randn(n, k, device="cuda") / k**0.5, Fp8Scheme(strategy))
        layer = Fp8Linear(k, n, None if strategy == "channel" else (128, 128), device="cuda")
        layer.weight.copy_(q)
        layer.weight_scale.copy_(layer.scale_from_checkpoint(scale))
        return layer

    down, gate_up = fp8(2560, 10240), fp8(20480, 2560)
    for rows in (1, 32, 100):
        x, h = torch.randn(rows, 10240, device="cuda").bfloat16(), torch.randn(rows, 2560, device="cuda").bfloat16()
        expected = F.linear(x.float(), down.dequantized(torch.float32))
        partials = linear_partials(x, down)
        chained = decode_fp8_applies(x, down.weight, down.block_k, TRITON_SPLITS)
        assert chained == (rows <= 32) and partials.dim() == (3 if chained else 2), rows  # on Hopper
        got = sum_partials(partials, torch.bfloat16) if chained else partials
        bound = 1e-2 if chained else 0.05
        assert (got.float() - expected).abs().max() / expected.abs().max() < bound, rows
        expected = gelu_tanh_mul_packed(F.linear(h.float(), gate_up.dequantized(torch.float32)).bfloat16()).float()
        error = (gelu_mlp(h, gate_up).float() - expected).abs().max() / expected.abs().max()
        weight_only = decode_fp8_applies(h, gate_up.weight, gate_up.block_k, GATED)
        assert error < (1e-2 if weight_only else 0.05), (rows, error)
