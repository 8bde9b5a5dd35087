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
