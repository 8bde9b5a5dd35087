"""kernels/decode_gemm_fp8_variants.py: the FP8 decode GEMM's variants (fp16 operands, the swapped product, W8A8
on FP8 tensor cores) on CPU in Triton's interpreter at small sizes, per-channel and 128 x 128 block scales:
the weight-only ones against the dequantize-then-matmul reference, W8A8 against the same reference with the
activations quantized as the kernel's docstring says (per row and K-step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_fixtures import fp8_layer, relative_error

from srt.kernels.decode_gemm import GATED, GemmTiles
from srt.kernels.decode_gemm_fp8_variants import (
    FP8_MAX,
    MIN_ABSMAX,
    VARIANTS,
    decode_gelu_mlp_fp8_variant,
    decode_linear_fp8_variant,
    decode_w8a8_applies,
    w8a8_gated_plan,
    w8a8_splits,
    w8a8_tiles,
)
from srt.kernels.decode_gemm_fp16 import decode_fp16_applies, fp16_plan
from srt.kernels.gelu_mul import gelu_tanh_mul_packed
from srt.kernels.triton_support import kernel_runs_on, pending_tickets
from srt.layers.fp8_linear import Fp8Linear

SMALL_TILES = GemmTiles(64, 64, 2)  # 64 rows: the swapped variants' smallest BLOCK_N (wgmma's M)
WEIGHT_ONLY = [name for name, variant in VARIANTS.items() if variant.operands != torch.float8_e4m3fn]


@pytest.fixture
def interpreter() -> None:
    """The CPU tests' skip where the kernel does not run in Triton's interpreter (a CUDA machine)."""
    kernel = decode_linear_fp8_variant.__globals__["_decode_gemm_fp8_variant_kernel"]
    if not kernel_runs_on(torch.device("cpu"), kernel):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")


def quantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the W8A8 kernel multiplies it, in float32: per row and `group` columns, q = x * (448 / absmax) rounded to
    e4m3 (torch rounds to nearest even, as the GPU's cvt.rn), times absmax / 448."""
    rows, k = x.shape
    x = x.float().view(rows, k // group, group)
    absmax = x.abs().amax(dim=2, keepdim=True).clamp(min=MIN_ABSMAX)
    fp8_max = torch.full_like(absmax, FP8_MAX)  # tensor divisions: IEEE, as the kernel's div_rn
    q = (x * (fp8_max / absmax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * (absmax / fp8_max)).view(rows, k)


def run(variant: str, x: torch.Tensor, layer: Fp8Linear, splits: int | str) -> torch.Tensor:
    args = (x, layer.weight, layer.weight_scale, layer.block_k, variant)
    if splits == GATED:
        return decode_gelu_mlp_fp8_variant(*args, tiles=SMALL_TILES)
    return decode_linear_fp8_variant(*args, splits=splits, tiles=SMALL_TILES)


def error(out: torch.Tensor, x: torch.Tensor, layer: Fp8Linear, splits: int | str) -> float:
    """`out`'s relative error against the float32 product of (already quantized) x with the dequantized weight,
    rounded where the kernel rounds (its 16-bit output; gelu * up's two inputs)."""
    product = F.linear(x.float(), layer.dequantized(torch.float32))
    if splits == GATED:
        return relative_error(out, gelu_tanh_mul_packed(product.bfloat16()))
    if splits == 1:
        return relative_error(out, product.bfloat16())
    assert out.shape == (splits, *product.shape) and out.dtype == torch.float32
    return relative_error(out.sum(0), product)


# bf16 output: one rounding step of the largest value; float32 partials: float32 rounding in another order
BOUNDS = {1: 1e-2, 2: 1e-5, GATED: 1e-2}


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("strategy", ["channel", "block"])
@pytest.mark.parametrize("variant", WEIGHT_ONLY)
def test_weight_only_variants_match_the_dequantized_reference(variant: str, strategy: str) -> None:
    """Rows 3 of 16, K 512: four 128-column scale blocks, so block scales change inside a K-chunk's loop."""
    layer = fp8_layer(128, 512, strategy, seed=128 + 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    for splits in (1, 2, GATED):
        out = run(variant, x, layer, splits)
        assert out.dtype == (torch.float32 if splits == 2 else x.dtype)
        assert error(out, x, layer, splits) < BOUNDS[splits], (variant, strategy, splits)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_w8a8_matches_the_reference_with_activations_quantized_per_row_and_k_step(strategy: str) -> None:
    layer = fp8_layer(128, 512, strategy, seed=128 + 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    x_q = quantized_activations(x, SMALL_TILES.block_k)
    for splits in (1, 2, GATED):
        out = run("w8a8", x, layer, splits)
        assert error(out, x_q, layer, splits) < BOUNDS[splits], (strategy, splits)
        # and within e4m3's rounding of the unquantized product
        assert error(out, x, layer, splits) < 0.08, (strategy, splits)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("strategy", ["channel", "block"])
@pytest.mark.parametrize("variant", ["w8a8", "fp16"])
def test_gated_gemm_in_k_chunks_equals_one_chunk(variant: str, strategy: str) -> None:
    """A gated GEMM over 2, 4 and 8 K-chunks (two column blocks; each block's last chunk sums the float32 partials
    and applies the gelu): the one-chunk kernel's values but for float32 summation order (the bf16 outputs at
    most a rounding step apart), within the reference's bound, and every ticket back at zero."""
    layer = fp8_layer(256, 512, strategy, seed=256 + 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    reference_x = quantized_activations(x, SMALL_TILES.block_k) if variant == "w8a8" else x
    args = (x, layer.weight, layer.weight_scale, layer.block_k, variant)
    whole = decode_gelu_mlp_fp8_variant(*args, tiles=SMALL_TILES)
    for chunks in (2, 4, 8):
        out = decode_gelu_mlp_fp8_variant(*args, tiles=SMALL_TILES, splits=chunks)
        assert out.shape == whole.shape and out.dtype == whole.dtype
        assert relative_error(out, whole) < 1e-2, chunks
        assert error(out, reference_x, layer, GATED) < BOUNDS[GATED], chunks
    assert pending_tickets("fp8_gated_gemm") == 0


@pytest.mark.usefixtures("interpreter")
def test_w8a8_zero_rows_give_zeros() -> None:
    """A zero row (like the tile's padding rows) quantizes with a tiny scale, not 0 / 0. (The interpreter's fp8
    cast turns NaN into 0, so a 0 / 0 shows only on the GPU: `test_variants_at_e4b_shapes` has a zero row.)"""
    layer = fp8_layer(64, 128, "channel", seed=64 + 128)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[1] = 0
    out = run("w8a8", x, layer, 1)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and out[0].abs().max() > 0


def test_swapped_variants_refuse_a_tile_narrower_than_wgmmas_m() -> None:
    layer = fp8_layer(64, 128, "channel", seed=64 + 128)
    x = torch.randn(2, 128).bfloat16()
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_linear_fp8_variant(
            x, layer.weight, layer.weight_scale, layer.block_k, "w8a8", tiles=GemmTiles(32, 64, 2)
        )


# E4B: qkv of sliding layers, o of full layers, gate_up, down
E4B_SHAPES = [(3072, 2560, 4), (2560, 4096, 4), (20480, 2560, GATED), (2560, 10240, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows", [1, 32])
def test_variants_at_e4b_shapes(variant: str, rows: int) -> None:
    """srt's FP8 tiles, per-channel scales; W8A8 against its quantized-activation reference, with a zero row."""
    from srt.kernels.decode_gemm_fp8 import decode_fp8_applies, decode_fp8_tiles

    if not decode_fp8_applies(torch.empty(1, 2560, device="cuda").bfloat16(), torch.empty(256, 2560), 2560, 1):
        pytest.skip("needs TMA (Hopper) and Triton's tensor descriptors")
    for n, k, splits in E4B_SHAPES:
        layer = fp8_layer(n, k, "channel", "cuda", seed=n + k)
        x = torch.randn(rows, k, device="cuda").bfloat16()
        if rows > 1:
            x[-1] = 0
        tiles = decode_fp8_tiles(splits, n // 2 if splits == GATED else n, k, k)
        args = (x, layer.weight, layer.weight_scale, layer.block_k, variant)
        if splits == GATED:
            out = decode_gelu_mlp_fp8_variant(*args, tiles=tiles)
        else:
            out = decode_linear_fp8_variant(*args, splits=splits, tiles=tiles)
        assert torch.isfinite(out).all(), (n, k, splits)
        reference_x = quantized_activations(x, tiles.block_k) if variant == "w8a8" else x
        # float32 partials: tensor-core accumulation in another order
        bound = 1e-2 if splits == GATED else 1e-3
        assert error(out, reference_x, layer, splits) < bound, (n, k, splits)


def test_srt_takes_w8a8_tiles_that_fit_each_shape() -> None:
    """4 K-splits: 128 x 128 tiles, 64-wide K-steps where a K-chunk is no multiple of 128 (31B); gate_up: 64 x 128;
    none where nothing fits (the weight-only kernel or the layer's own GEMM then runs)."""
    assert w8a8_tiles(4, 2560, 10240, 10240) == GemmTiles(128, 128, 3, 8)  # E4B down, per channel
    assert w8a8_tiles(4, 2560, 10240, 128) == GemmTiles(128, 128, 3, 8)  # 128 x 128 block scales
    assert w8a8_tiles(4, 16384, 5376, 5376) == GemmTiles(256, 64, 6, 4)  # 31B qkv: chunks of 1344
    assert w8a8_tiles(GATED, 21504, 5376, 5376) == GemmTiles(64, 128, 3, 4)  # 31B gate_up, each half
    assert w8a8_tiles(GATED, 2112, 2816, 2816) == GemmTiles(64, 128, 3, 4)  # 26B-A4B gate_up (bf16 tiles: none)
    assert w8a8_tiles(4, 2816, 2112, 2112) is None  # 26B-A4B down: K-chunks of 528 columns
    assert not decode_w8a8_applies(torch.zeros(1, 2560).bfloat16(), torch.zeros(2560, 2560), 2560, 4)  # CPU


def test_srt_splits_k_to_fill_the_gpu_with_wide_tiles() -> None:
    """8 K-chunks where 4 would run under a wave of 128-column programs, if 128-wide K-steps fit (E4B q: no);
    2 where those fit halves of K but not quarters; where no tiles fit quarters, the fewest chunks of whole
    64-wide K-steps that fill a wave; else 4."""
    assert w8a8_splits(2560, 10240, 10240) == 8  # E4B down: 80 programs at 4 chunks
    assert w8a8_splits(2816, 4096, 128) == 8  # 26B-A4B o, 128 x 128 block scales
    assert w8a8_splits(2048, 2560, 2560) == 4  # E4B q: 2560 / 8 = 320 columns per chunk
    assert w8a8_splits(3072, 2560, 2560) == 4  # E4B qkv: 96 programs
    assert w8a8_splits(16384, 5376, 5376) == 2  # 31B qkv: 1344 / 128 is no whole number
    assert w8a8_splits(5376, 21504, 5376) == 4  # 31B down
    # 26B-A4B's dense down, K 2112 = 33 x 64: 3 chunks run 66 programs of 128 columns, 11 chunks 242
    assert w8a8_splits(2816, 2112, 2112) == 11
    assert w8a8_tiles(11, 2816, 2112, 2112) == GemmTiles(128, 64, 4, 4)
    assert w8a8_splits(2816, 2112, 128) == 11  # and with 128 x 128 block scales: 64-wide steps in 128-wide blocks
    assert w8a8_tiles(5, 2816, 2112, 2112) is None  # 2112 / 5 is no whole number of columns


def test_srt_splits_narrow_gated_gemms_in_k_chunks() -> None:
    """One chunk where the 64-column blocks fill a wave (E4B, 31B gate_up); else the fewest chunks of whole
    K-steps, 128 columns wide, else 64, that do (26B-A4B's dense gate_up: 33 blocks, K 2816 = 44 x 64)."""
    assert w8a8_gated_plan(10240, 2560, 2560) == (GemmTiles(64, 128, 3, 4), 1)
    assert w8a8_gated_plan(21504, 5376, 5376) == (GemmTiles(64, 128, 3, 4), 1)
    assert w8a8_gated_plan(2112, 2816, 2816) == (GemmTiles(64, 64, 6, 4), 4)
    assert w8a8_gated_plan(2112, 2816, 128) == (GemmTiles(64, 64, 6, 4), 4)
    assert w8a8_gated_plan(2048, 4096, 4096) == (GemmTiles(64, 128, 3, 4), 4)  # 32 blocks, 32 steps of 128


# through the layers: E4B qkv (sliding), gate_up, down (8 chunks); 31B qkv (full, 2 chunks), gate_up; 26B-A4B gate_up
LAYER_SHAPES = [
    (3072, 2560, 4),
    (20480, 2560, GATED),
    (2560, 10240, 4),
    (18432, 5376, 4),
    (43008, 5376, GATED),
    (4224, 2816, GATED),
    (2816, 2112, 4),  # 26B-A4B's dense down: 11 chunks
]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["channel", "block"])
@pytest.mark.parametrize("rows", [2, 32])
def test_fp8_projections_decode_weight_only_in_float16(strategy: str, rows: int) -> None:
    """`project` / `gelu_mlp` of an Fp8Linear at decode sizes on Hopper take the weight-only float16 kernel in
    `fp16_plan`'s tiles and K-chunks and give the dequantized weights' product within float32 / bf16 rounding (no
    activation quantization). (One row of per-channel weights takes the CUDA-core kernel:
    test_decode_gemv_fp8_kernel.py.)"""
    from srt.layers.linear import gelu_mlp, project

    for n, k, kind in LAYER_SHAPES:
        layer = fp8_layer(n, k, strategy, "cuda", seed=n + k)
        x = torch.randn(rows, k, device="cuda").bfloat16()
        gated = kind == GATED
        if not decode_fp16_applies(x, layer.weight, layer.block_k, gated):
            pytest.skip("needs TMA (Hopper) and Triton's tensor descriptors")
        out = gelu_mlp(x, layer) if gated else project(x, layer)
        chunks = fp16_plan(n // 2 if gated else n, k, layer.block_k)[1]
        splits = GATED if gated else chunks
        assert out.shape[0] == chunks or splits in (1, GATED), (n, k, out.shape)
        bound = 1e-2 if splits in (1, GATED) else 1e-4  # a 16-bit output; float32 partials in another sum order
        assert error(out, x, layer, splits) < bound, (n, k, splits)
