"""kernels/fp8_block_gemm.py: the block-scaled FP8 GEMM (per token and 128-group activations, 128 x 128 weight
blocks) against both operands dequantized: in Triton's interpreter at small, ragged sizes; on the GPU at the
prefill shapes of E4B and 31B."""

from __future__ import annotations

import pytest
import torch

from srt.kernels.fp8_block_gemm import _block_fp8_gemm_kernel, block_fp8_gemm, block_fp8_gemm_reference
from srt.kernels.fp8_quant import quantize_fp8_reference
from srt.kernels.triton_support import kernel_runs_on
from srt.model_loader.fp8 import Fp8Scheme, quantize


def operands(rows: int, n: int, k: int, device: str) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device).manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=generator, device=device)
    weight = torch.randn(n, k, generator=generator, device=device) / k**0.5
    w_q, tile_scale = quantize(weight, Fp8Scheme("block"))
    w_scale = tile_scale.repeat_interleave(128, dim=0)[:n]  # Fp8Linear's row form
    return (*quantize_fp8_reference(x, 128), w_q, w_scale)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def test_interpreted_kernel_matches_the_dequantized_operands() -> None:
    if not kernel_runs_on(torch.device("cpu"), _block_fp8_gemm_kernel):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    args = operands(5, 200, 300, "cpu")  # ragged rows, columns and K-blocks
    got = block_fp8_gemm(*args, 128, torch.float32, use_triton=True)
    assert relative_error(got, block_fp8_gemm_reference(*args, 128, torch.float32)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(20480, 2560), (2560, 10240), (18432, 5376), (5376, 21504)])
def test_kernel_at_prefill_shapes(n: int, k: int) -> None:
    for rows in (33, 512):
        args = operands(rows, n, k, "cuda")
        got = block_fp8_gemm(*args, 128, torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert relative_error(got, block_fp8_gemm_reference(*args, 128, torch.float32)) < 1e-2, (rows, n, k)
