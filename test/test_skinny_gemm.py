"""`skinny_linear` (decode-sized x @ W^T in Triton) against F.linear and the gelu * up the MLP runs on it.

On the CPU the kernel runs under Triton's interpreter (`use_triton=True`, TRITON_INTERPRET=1 from conftest) at
small shapes, through every variant: one row (multiply-and-sum) and tiles of rows (tl.dot), plain and gated
(gate_up with gelu * up). The `gpu` tests run E4B sizes with the tuned tiles and a CUDA graph replay.

16-bit checks are in ulps of sum_k |x_k * W_nk|: the kernel accumulates in float32 in its own order and
rounds once, as cuBLAS does, so the two may differ by a rounding step of that sum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from srt.layers.fused_kernels import gelu_tanh_mul_packed  # noqa: E402
from srt.layers.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_linear, tuned_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, k, generator=generator)).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    return x, weight


def assert_close_in_ulps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, ulps: float) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    bound = ulps * torch.finfo(got.dtype).eps * magnitude.float() + 1e-30
    error = (got.float() - expected.float()).abs()
    assert bool((error <= bound).all()), f"off by up to {(error / bound).max().item():.2f} x {ulps} ulps"


def magnitude(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float().abs() @ weight.float().abs().T


CONFIGS = [
    SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=1),
    SkinnyConfig(block_n=32, block_k=16, num_warps=4, num_stages=1),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["n16-k32", "n32-k16"])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(rows: int, dtype: torch.dtype, config: SkinnyConfig) -> None:
    x, weight = operands(rows, 40, 96, dtype)  # 40 columns: the last N-block is partly masked
    got = skinny_linear(x, weight, config=config, use_triton=True)
    expected = F.linear(x, weight) if dtype == torch.float32 else F.linear(x.float(), weight.float()).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert_close_in_ulps(got, expected, magnitude(x, weight), ulps=1)


@pytest.mark.parametrize("config", CONFIGS, ids=["n16-k32", "n32-k16"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_matches_gelu_tanh_mul_of_the_gemm(rows: int, dtype: torch.dtype, config: SkinnyConfig) -> None:
    x, weight = operands(rows, 2 * 48, 96, dtype, seed=1)  # stacked gate (48 rows) and up (48 rows)
    got = skinny_linear(x, weight, gated=True, config=config, use_triton=True)
    expected = gelu_tanh_mul_packed(F.linear(x.float(), weight.float()).to(dtype), use_triton=False)
    assert got.shape == (rows, 48)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # a GEMM output one rounding step apart moves gelu * up by about an ulp of the largest products
        error = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert error <= 2.0**-7, error


def test_unsupported_shapes_fall_back_or_refuse() -> None:
    x, weight = operands(MAX_ROWS + 1, 16, 64, torch.float32)
    assert tuned_config(4, 16, 64, gated=False) is None  # plain projections: cuBLAS was as fast
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight))  # use_triton=None: falls back
    with pytest.raises(ValueError, match="unsupported"):
        skinny_linear(x, weight, use_triton=True)
    with pytest.raises(ValueError, match="gated"):
        skinny_linear(x[:1], weight[:15], gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize(("n", "k", "gated"), [(2048, 2560, False), (2560, 10240, False), (10240, 2560, True)])
def test_e4b_sizes_on_gpu(rows: int, n: int, k: int, gated: bool) -> None:
    x, weight = operands(rows, 2 * n if gated else n, k, torch.bfloat16)
    expected = F.linear(x, weight)
    if gated:
        expected = gelu_tanh_mul_packed(expected)
    got = skinny_linear(x, weight, gated=gated, config=tuned_config(rows, n, k, gated), use_triton=gated or None)
    error = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error < 2e-2, error


@pytest.mark.gpu
def test_gated_replays_in_a_cuda_graph() -> None:
    x, weight = operands(8, 2 * 10240, 2560, torch.bfloat16)
    skinny_linear(x, weight, gated=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, weight, gated=True)
    for seed in range(3):
        x.copy_(operands(8, 2 * 10240, 2560, torch.bfloat16, seed=seed + 1)[0])
        graph.replay()
        expected = gelu_tanh_mul_packed(F.linear(x, weight))
        assert (out.float() - expected.float()).abs().max() / expected.float().abs().max() < 2e-2


def test_tuned_tiles_only_for_wide_gate_up_at_up_to_16_rows() -> None:
    """The fused kernel runs where the H100 measured a gain: E4B's gate_up (I = 10240) up to 16 rows; never
    for plain projections, 32 rows, or an MLP too narrow to fill the GPU (26B-A4B's I = 2112)."""
    assert tuned_config(1, 10240, 2560, gated=True) is not None
    assert tuned_config(16, 10240, 2560, gated=True) is not None
    assert tuned_config(32, 10240, 2560, gated=True) is None
    assert tuned_config(1, 10240, 2560, gated=False) is None
    assert tuned_config(1, 2112, 2816, gated=True) is None
