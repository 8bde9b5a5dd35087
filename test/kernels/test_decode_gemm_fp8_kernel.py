"""kernels/decode_gemm_fp8.py: the chained decode GEMM over FP8 weights against the dequantize-then-matmul
reference, per-channel and 128 x 128 block scales: on CPU in Triton's interpreter at small sizes, on Hopper at
E4B's and 31B's real shapes inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_fixtures import fp8_layer, relative_error

from srt.kernels.decode_gemm import GATED, GemmTiles, tiles_for
from srt.kernels.decode_gemm_fp8 import decode_fp8_applies, decode_fp8_tiles, decode_gelu_mlp_fp8, decode_linear_fp8
from srt.kernels.gelu_mul import gelu_tanh_mul_packed
from srt.kernels.triton_support import kernel_runs_on
from srt.layers.fp8_linear import Fp8Linear

SMALL_TILES = GemmTiles(64, 64, 2)


def check(x: torch.Tensor, layer: Fp8Linear, splits: int | str, tiles: GemmTiles | None = None) -> float:
    """The kernel's relative error against the float32 product with the dequantized weight (the kernel
    multiplies the exact FP8 values and applies the scales in float32), rounded to x's dtype where the kernel
    rounds (its bf16 output; gelu * up's two inputs)."""
    product = F.linear(x.float(), layer.dequantized(torch.float32)).to(x.dtype)
    args = (layer.weight, layer.weight_scale, layer.block_k)
    if splits == GATED:
        out = decode_gelu_mlp_fp8(x, *args, tiles=tiles)
        assert out.dtype == x.dtype
        return relative_error(out, gelu_tanh_mul_packed(product))
    out = decode_linear_fp8(x, *args, splits=splits, tiles=tiles)
    assert out.dtype == (x.dtype if splits == 1 else torch.float32)
    if splits == 1:
        return relative_error(out, product)
    return relative_error(out.sum(0), F.linear(x.float(), layer.dequantized(torch.float32)))


def test_never_applies_off_cuda() -> None:
    layer = fp8_layer(256, 256, "channel", seed=256 + 256)
    x = torch.randn(4, 256).bfloat16()
    assert not any(decode_fp8_applies(x, layer.weight, layer.block_k, s) for s in (1, 4, GATED))


def test_tiles_take_twice_the_bf16_k_where_chunks_and_scale_blocks_allow() -> None:
    assert decode_fp8_tiles(4, 2560, 10240, 10240).block_k == 2 * tiles_for(4, 2560).block_k  # E4B down
    assert decode_fp8_tiles(4, 18432, 5376, 5376) == tiles_for(4, 18432)  # 31B qkv: K-chunks of 1344
    assert decode_fp8_tiles(4, 2048, 2560, 128) == tiles_for(4, 2048)  # narrow tiles' 128 is the block already
    assert decode_fp8_tiles(GATED, 10240, 2560, 2560).stages < tiles_for(GATED, 10240).stages  # shared memory
    assert decode_fp8_tiles(4, 2560, 10240, 32) is None  # scale blocks narrower than a K-step


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_interpreted_kernel_matches_the_dequantized_reference(strategy: str) -> None:
    """Rows 3 of 16, K 512 (four 128-column scale blocks, so block scales change inside a K-chunk's loop)."""
    layer = fp8_layer(128, 512, strategy, seed=128 + 512)
    if not kernel_runs_on(torch.device("cpu"), decode_linear_fp8.__globals__["_decode_gemm_fp8_kernel"]):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    x = torch.randn(3, 512).bfloat16()
    for splits in (1, 2, GATED):
        # bf16 output: within one rounding step of the largest value; the float32 partials: float32 rounding
        assert check(x, layer, splits, SMALL_TILES) < (1e-5 if splits == 2 else 1e-2), (strategy, splits)


# E4B: qkv of sliding layers, o of full layers, gate_up, down; 31B: qkv of full (k_eq_v) layers, o, gate_up, down
REAL_SHAPES = [
    (3072, 2560, 4), (2560, 4096, 4), (20480, 2560, GATED), (2560, 10240, 4),
    (18432, 5376, 4), (5376, 16384, 4), (43008, 5376, GATED), (5376, 21504, 4),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["channel", "block"])
@pytest.mark.parametrize("rows", [1, 32])
def test_kernel_at_real_shapes_in_a_graph(strategy: str, rows: int) -> None:
    if not decode_fp8_applies(torch.empty(1, 2560, device="cuda").bfloat16(), torch.empty(256, 2560), 2560, 1):
        pytest.skip("needs TMA (Hopper) and Triton's tensor descriptors")
    for n, k, splits in REAL_SHAPES:
        layer = fp8_layer(n, k, strategy, "cuda", seed=n + k)
        x = torch.randn(rows, k, device="cuda").bfloat16()
        assert decode_fp8_applies(x, layer.weight, layer.block_k, splits), (n, k, splits)
        source = torch.zeros_like(x)
        args = (layer.weight, layer.weight_scale, layer.block_k)

        def run(splits=splits, args=args, source=source) -> torch.Tensor:  # a kernel ahead writes the input
            if splits == GATED:
                return decode_gelu_mlp_fp8(source * 1, *args)
            return decode_linear_fp8(source * 1, *args, splits=splits)

        run()  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        source.copy_(x)
        graph.replay()
        if splits == GATED:
            expected = gelu_tanh_mul_packed(F.linear(x.float(), layer.dequantized(torch.float32)).bfloat16())
            error, bound = relative_error(out, expected), 1e-2  # a bf16 rounding step
        else:  # tensor-core float32 accumulation in another order
            error, bound = relative_error(out.sum(0), F.linear(x.float(), layer.dequantized(torch.float32))), 1e-3
        assert error < bound, (n, k, splits, strategy, error)
