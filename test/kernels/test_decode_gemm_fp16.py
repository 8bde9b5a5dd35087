"""kernels/decode_gemm_fp16.py: the weight-only float16 decode GEMM's plan (tiles and K-chunks per weight shape) and
its saturation of rows beyond float16's range, on CPU in Triton's interpreter at small sizes. (Its products at
the models' shapes through the layers, on the GPU: test_decode_gemm_fp8_variants.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_fixtures import fp8_layer, relative_error

from srt.kernels.decode_gemm import GemmTiles
from srt.kernels.decode_gemm_fp8_variants import decode_gelu_mlp_fp8_variant, decode_linear_fp8_variant
from srt.kernels.decode_gemm_fp16 import VARIANT, WAVE_PROGRAMS, decode_fp16_applies, fp16_plan
from srt.kernels.gelu_mul import gelu_tanh_mul_packed
from srt.kernels.triton_support import kernel_runs_on

WIDE, MIDDLE, NARROW = GemmTiles(64, 256, 3, 4), GemmTiles(64, 128, 4, 4), GemmTiles(64, 64, 6, 4)


def test_plan_takes_the_fewest_k_chunks_that_fill_a_wave() -> None:
    """The H100 sweep's fastest swapped tiles and chunks, shape by shape (module docstring): one chunk where the
    64-row programs already fill a wave, else the fewest that do, in the widest K-steps that divide them."""
    assert fp16_plan(3072, 2560, 2560) == (MIDDLE, 4)  # E4B qkv: 48 blocks; quarters of 640 columns
    assert fp16_plan(2560, 10240, 2560 * 4) == (WIDE, 4)  # E4B down
    assert fp16_plan(10240, 2560, 2560) == (WIDE, 1)  # E4B gate_up, each half: 160 blocks
    assert fp16_plan(6144, 2560, 2560) == (WIDE, 2)  # E4B qkv of full layers
    assert fp16_plan(8192, 2816, 2816) == (WIDE, 1)  # 26B-A4B qkv: 128 blocks
    assert fp16_plan(2816, 4096, 4096) == (WIDE, 4)  # 26B-A4B o
    assert fp16_plan(2112, 2816, 2816) == (NARROW, 4)  # 26B-A4B gate_up half: 33 blocks, chunks of 704 = 11 x 64
    assert fp16_plan(2816, 2112, 2112) == (NARROW, 3)  # 26B-A4B down: K = 33 x 64
    assert fp16_plan(5376, 8192, 8192) == (WIDE, 2)  # 31B o
    assert fp16_plan(2816, 4096, 128) == (MIDDLE, 4)  # 128 x 128 block scales: no 256-wide K-steps
    for n, k in ((3072, 2560), (2816, 2112), (5376, 21504)):
        tiles, chunks = fp16_plan(n, k, k)
        assert n // tiles.block_n * chunks >= WAVE_PROGRAMS and k % (chunks * tiles.block_k) == 0
    assert fp16_plan(100, 2560, 2560) is None  # no 64-row blocks
    assert not decode_fp16_applies(torch.zeros(2, 2560).bfloat16(), torch.zeros(2560, 2560), 2560)  # CPU


@pytest.fixture
def interpreter() -> None:
    kernel = decode_linear_fp8_variant.__globals__["_decode_gemm_fp8_variant_kernel"]
    if not kernel_runs_on(torch.device("cpu"), kernel):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.mark.usefixtures("interpreter")
def test_rows_beyond_float16_saturate() -> None:
    """A bf16 activation of 1e6 becomes 65504 in the float16 operand, not inf: the products stay finite and equal
    the reference over the saturated rows, for a plain and a gated GEMM."""
    layer = fp8_layer(128, 256, "channel", seed=128 + 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[1, 5] = 1e6
    saturated = x.float().clamp(-65504.0, 65504.0)
    args = (x, layer.weight, layer.weight_scale, layer.block_k, VARIANT)
    out = decode_linear_fp8_variant(*args, tiles=GemmTiles(64, 64, 2))
    expected = F.linear(saturated, layer.dequantized(torch.float32))
    assert torch.isfinite(out).all() and relative_error(out, expected.bfloat16()) < 1e-2
    gated = decode_gelu_mlp_fp8_variant(*args, tiles=GemmTiles(64, 64, 2))
    assert torch.isfinite(gated).all()
    assert relative_error(gated, gelu_tanh_mul_packed(expected.bfloat16())) < 1e-2
