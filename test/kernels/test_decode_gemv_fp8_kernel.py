"""kernels/decode_gemv_fp8.py: the CUDA-core FP8 projection of 1-4 rows against the dequantize-then-matmul
reference, on CPU in Triton's interpreter at small sizes and on the GPU at Gemma 4's shapes; its e4m3 -> float32
bit placement exact over all 256 byte values (subnormals and signed zeros included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_fixtures import fp8_layer, relative_error

from srt.kernels.decode_gemm import GATED
from srt.kernels.decode_gemv_fp8 import (
    GemvTiles,
    _fp8_gemv_kernel,
    decode_gelu_mlp_gemv,
    decode_gemv_applies,
    decode_linear_gemv,
    gemv_fits,
    gemv_splits,
    gemv_tiles,
)
from srt.kernels.gelu_mul import gelu_tanh_mul_packed
from srt.kernels.triton_support import has_pdl, is_interpreted, jit, kernel_runs_on, l2_prefetch_bytes, tl

SMALL_TILES = GemvTiles(8, 64)


@pytest.fixture
def interpreter() -> None:
    if not kernel_runs_on(torch.device("cpu"), _fp8_gemv_kernel):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")


@jit
def _cast_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):  # the kernel's e4m3 -> float32 cast, alone
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(w_ptr + offs).to(tl.float8e4nv, bitcast=True).to(tl.float32))


def expected(x: torch.Tensor, layer: object, splits: int | str) -> torch.Tensor:
    """The float32 product with the dequantized weight, rounded where the kernel rounds."""
    product = F.linear(x.float(), layer.dequantized(torch.float32))
    if splits == GATED:
        return gelu_tanh_mul_packed(product.to(x.dtype))
    return product.to(x.dtype) if splits == 1 else product


def run(x: torch.Tensor, layer: object, splits: int | str, tiles: GemvTiles | None = None) -> torch.Tensor:
    if splits == GATED:
        return decode_gelu_mlp_gemv(x, layer.weight, layer.weight_scale, tiles)
    return decode_linear_gemv(x, layer.weight, layer.weight_scale, splits, tiles)


def summed(out: torch.Tensor) -> torch.Tensor:
    return out.sum(0) if out.dim() == 3 else out


# bf16 outputs: one rounding of the largest value; float32 partials: float32 sums in another order
BOUNDS = {1: 1e-2, 2: 1e-5, 4: 1e-5, GATED: 1e-2}


def check_cast(device: str) -> None:
    w = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w)  # e4m3fn's two NaN encodings: no weight holds them
    out = torch.empty(256, dtype=torch.float32, device=device)
    _cast_kernel[(1,)](w, out, BLOCK=256)
    reference = w.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.view(torch.int32), reference.view(torch.int32))  # bit for bit: -0 and subnormals too


@pytest.mark.usefixtures("interpreter")
def test_e4m3_bytes_become_their_float32_values_exactly() -> None:
    check_cast("cpu")


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_gemv_matches_the_dequantized_reference(rows: int, stages: int) -> None:
    """K 256 over 64-byte K-steps (4 steps, with and without a software pipeline), 1 and 2 K-chunks, gate_up with
    gelu * up; a row count that pads (3 of 4)."""
    layer = fp8_layer(64, 256, "channel", seed=64 + 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    for splits in (1, 2, GATED):
        out = run(x, layer, splits, SMALL_TILES._replace(stages=stages))
        assert out.dtype == (torch.float32 if splits == 2 else x.dtype)
        shape = (rows, 32 if splits == GATED else 64)
        assert out.shape == (shape if splits != 2 else (2, *shape))
        assert relative_error(summed(out), expected(x, layer, splits)) < BOUNDS[splits], (rows, splits)


@pytest.mark.usefixtures("interpreter")
def test_subnormal_weights_multiply_exactly() -> None:
    """Weights that quantize to e4m3 subnormals (|q| < 2^-6) keep their value: 0 everywhere but subnormals and one
    large value per row, against the exact float64 product."""
    layer = fp8_layer(8, 64, "channel", seed=3)
    q = torch.full((8, 64), 2.0**-9).mul(torch.arange(1, 65).remainder(8).float()).to(torch.float8_e4m3fn)
    q[:, 0] = 448.0
    layer.weight.copy_(q)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = decode_linear_gemv(x, layer.weight, layer.weight_scale, 2, SMALL_TILES._replace(block_k=32))
    exact = x.double() @ (q.double() * layer.weight_scale.double()).t()
    assert torch.allclose(out.sum(0).double(), exact, rtol=1e-6, atol=0)


def test_fits_per_channel_weights_of_one_to_four_rows_only() -> None:
    assert gemv_fits(1, 2560, 10240, 10240, 4) and gemv_fits(4, 20480, 2560, 2560, GATED)
    assert not gemv_fits(5, 2560, 10240, 10240, 4)
    assert not gemv_fits(1, 2560, 10240, 128, 4)  # 128 x 128 block scales
    assert not gemv_fits(1, 2816, 2112, 2112, 1)  # 26B-A4B's dense down: K no multiple of 256
    assert not gemv_fits(1, 2560, 2560, 2560, 4)  # K-chunks of 640: no whole number of 256-byte steps
    assert not decode_gemv_applies(torch.zeros(1, 2560).bfloat16(), torch.zeros(2560, 2560), 2560, 5)  # CPU


def test_tiles_follow_the_weight_shape() -> None:
    """8-column programs up to NARROW_N output columns, 16 above; the MLP's gate_up 8 x 512 where K is a multiple of
    512, else 16 x 256."""
    assert gemv_tiles(2560, 10240, False).block_n == 8 and gemv_tiles(3072, 2560, False).block_n == 8  # E4B
    assert gemv_tiles(6144, 2560, False).block_n == 16 and gemv_tiles(5376, 8192, False).block_n == 16  # 31B
    assert gemv_tiles(10240, 2560, True)[:2] == (8, 512)  # E4B gate_up (each half's rows)
    assert gemv_tiles(21504, 5376, True)[:2] == (16, 256)  # 31B: K = 21 x 256
    assert gemv_fits(1, 43008, 5376, 5376, GATED) and not gemv_fits(1, 43008, 5376, 5376, GATED, GemvTiles(8, 512))


def test_splits_keep_few_programs_or_short_chunks() -> None:
    """Where one chunk has up to FEW_PROGRAMS programs, N x chunks within FEW_COLUMNS; else chunks of <= 8 K-steps;
    the MLP's down (K >= 2N) at least FILLING_PROGRAMS programs."""
    assert gemv_splits(3072, 2560) == 1  # E4B qkv (sliding): 384 programs of 8 columns
    assert gemv_splits(6144, 2560) == 1  # E4B qkv (full): 384 of 16
    assert gemv_splits(2560, 10240) == 4  # E4B down: 320 a chunk -> 1280
    assert gemv_splits(2560, 2048) == 2  # E4B o (sliding): 320 a chunk, halves of 4 steps
    assert gemv_splits(2048, 2560) == 2  # E4B q of KV-shared sliding layers: 256 a chunk, halves of 5 steps
    assert gemv_splits(5376, 21504) == 4  # 31B down: 336 a chunk -> 1344
    assert gemv_splits(5376, 10752) == 6  # 31B down over 2 GPUs: 42 steps; thirds give 1008 programs, sixths 2016
    assert gemv_splits(5376, 8192) == 1  # 31B o (sliding): 336 programs
    assert gemv_splits(16384, 5376) == 3  # 31B qkv (sliding): 1024 programs, 21 steps -> 3 chunks of 7
    assert gemv_splits(2816, 2112) == 1  # no whole steps: gemv_fits refuses it


# E4B qkv (sliding), o (full), gate_up, down; 31B qkv (full), gate_up, down: 256-byte K-steps fit them all
GPU_SHAPES = [
    (3072, 2560, 5),
    (2560, 4096, 4),
    (20480, 2560, GATED),
    (2560, 10240, 4),
    (18432, 5376, 3),
    (43008, 5376, GATED),
    (5376, 21504, 4),
]


def test_l2_prefetch_takes_16_byte_multiples_on_chained_launches_only() -> None:
    """The GPU tests below run the kernels with their prefetch on (chained on Hopper); the CPU never prefetches
    (no chained launch there, and the interpreter has no inline assembly)."""
    assert l2_prefetch_bytes(torch.device("cpu"), _fp8_gemv_kernel, 2560) == 0
    cuda = torch.device("cuda")
    if torch.cuda.is_available() and has_pdl(cuda) and not is_interpreted(_fp8_gemv_kernel):
        assert l2_prefetch_bytes(cuda, _fp8_gemv_kernel, 2560, 256) == 256
        assert l2_prefetch_bytes(cuda, _fp8_gemv_kernel, 200, 256) == 192  # 16-byte multiples


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 6])
@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_at_gemma4_shapes(rows: int, stages: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_cast("cuda")
    for n, k, splits in GPU_SHAPES:
        layer = fp8_layer(n, k, "channel", "cuda", seed=n + k)
        x = torch.randn(rows, k, device="cuda").bfloat16()
        out = run(x, layer, splits, GemvTiles(8, 256, 4, stages))
        assert torch.isfinite(out).all(), (n, k, splits)
        bound = 1e-3 if splits not in (1, GATED) else BOUNDS[splits]
        assert relative_error(summed(out), expected(x, layer, splits)) < bound, (n, k, splits)


@pytest.mark.gpu
def test_one_row_fp8_projections_take_the_gemv() -> None:
    """`project` / `gelu_mlp` of a per-channel Fp8Linear for one row on CUDA: srt's tiles and K-chunks, the
    weight-only product (no activation quantization), at E4B's and 31B's shapes."""
    from srt.layers.linear import gelu_mlp, project

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for n, k, kind in GPU_SHAPES:
        layer = fp8_layer(n, k, "channel", "cuda", seed=n + k)
        x = torch.randn(1, k, device="cuda").bfloat16()
        splits = GATED if kind == GATED else gemv_splits(n, k)
        assert decode_gemv_applies(x, layer.weight, layer.block_k, splits), (n, k)
        assert not decode_gemv_applies(torch.cat([x, x]), layer.weight, layer.block_k, splits)  # 2 rows: tensor cores
        out = gelu_mlp(x, layer) if splits == GATED else project(x, layer)
        assert out.shape[0] == splits or splits in (1, GATED), (n, k, out.shape)
        form = splits if splits == GATED or out.dim() == 3 else 1  # one K-chunk: the product in x's dtype
        bound = 1e-3 if out.dim() == 3 else 1e-2
        assert relative_error(summed(out), expected(x, layer, form)) < bound, (n, k)
