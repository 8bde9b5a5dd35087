"""kernels/fp8_quant.py: dynamic FP8 activation quantization (per token; per token and 128-column group) against
its torch reference, value for value: in Triton's interpreter at small sizes, on the GPU at prefill shapes."""

from __future__ import annotations

import pytest
import torch

from srt.kernels.fp8_quant import _quantize_kernel, quantize_fp8, quantize_fp8_reference
from srt.kernels.triton_support import kernel_runs_on


def assert_same(x: torch.Tensor, group: int | None) -> None:
    q, scale = quantize_fp8(x, group, use_triton=True)
    expected_q, expected_scale = quantize_fp8_reference(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == expected_scale.shape
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.float(), expected_q.float())  # value for value (-0 == +0: the interpreter drops -0's sign)


@pytest.mark.parametrize("group", [None, 128])
def test_interpreted_kernel_equals_the_reference(group: int | None) -> None:
    if not kernel_runs_on(torch.device("cpu"), _quantize_kernel):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    x = (torch.randn(3, 300) * torch.logspace(-2, 1, 300)).bfloat16()  # 300: a partial last group
    x[1] = 0  # an all-zero row keeps a tiny scale, not a division by zero
    x[2, :4] = torch.tensor([-1e-6, 1e-6, -3e-3, 3e-3])  # under half the smallest subnormal: -0 and +0; subnormals
    assert_same(x, group)


def test_reference_off_cuda() -> None:
    x = torch.randn(2, 64)
    q, scale = quantize_fp8(x)
    assert torch.equal(scale, x.abs().amax(1, keepdim=True) / 448)
    assert q.float().abs().max() == 448


@pytest.mark.gpu
@pytest.mark.parametrize("group", [None, 128])
def test_kernel_at_prefill_shapes(group: int | None) -> None:
    for rows, k in ((7000, 2560), (512, 10240), (33, 5376), (1, 21504)):
        assert_same(torch.randn(rows, k, device="cuda").bfloat16() * 3, group)
