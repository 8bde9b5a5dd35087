"""kernels/per_layer_projection.py: the per-layer-input (PLE) block kernels against the torch ops.

On the CPU the kernels run under Triton's interpreter (`use_triton=True`, TRITON_INTERPRET=1 from conftest) at
tiny shapes; the `gpu` tests run E4B sizes and a CUDA graph replay.

16-bit checks are in ulps of the sum the projection rounds (sum_j |gated_j * W_ij|): the kernels round where
torch rounds, but float32 noise (summation order, exp vs tanh) may flip the last bit of a rounded gate or gelu
value, which moves the output by about an ulp of that sum's terms.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import DEVICE

from srt.kernels.gelu_mul import gelu_tanh_mul, gelu_tanh_mul_reference
from srt.kernels.per_layer_projection import (
    MAX_ROWS,
    ProjectionTiles,
    per_layer_input_projection,
    per_layer_input_projection_reference,
)
from srt.kernels.triton_support import pending_tickets

LAYERS = 3  # per_layer_input is a slice of a [rows, layers, ple_dim] tensor, as in the model


class Block:
    """Inputs and weights of one PLE block; per_layer_input (and hidden, if `strided`) are offset views."""

    def __init__(self, rows: int, hidden_size: int, ple_dim: int, dtype: torch.dtype, strided: bool, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        wide = 2 * hidden_size if strided else hidden_size
        self.hidden = (3 * torch.randn(rows, wide, generator=generator)).to(DEVICE, dtype)[:, :hidden_size]
        per_layer = torch.randn(rows, LAYERS, ple_dim, generator=generator).to(DEVICE, dtype)
        self.per_layer_input = per_layer[:, 1]  # row stride LAYERS * ple_dim
        self.gate_weight = (torch.randn(ple_dim, hidden_size, generator=generator) / hidden_size**0.5).to(DEVICE, dtype)
        self.projection_weight = (torch.randn(hidden_size, ple_dim, generator=generator) / ple_dim**0.5).to(
            DEVICE, dtype
        )

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hidden, self.per_layer_input, self.gate_weight, self.projection_weight

    def summed_magnitude(self) -> torch.Tensor:
        """sum_j |gated_j * W_ij| per output: the size of what the projection sums and rounds."""
        gated = gelu_tanh_mul_reference(F.linear(self.hidden, self.gate_weight), self.per_layer_input)
        return gated.float().abs() @ self.projection_weight.float().abs().T


def assert_within_ulps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, ulps: float) -> None:
    """|got - expected| <= ulps ulps (of got's dtype) of `magnitude`, elementwise."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    exponent = torch.floor(torch.log2(magnitude.float().clamp_min(2.0**-100)))
    bound = ulps * torch.finfo(got.dtype).eps * torch.pow(2.0, exponent)
    error = (got.float() - expected.float()).abs()
    worst = (error / bound).max().item() if error.numel() else 0.0
    assert bool((error <= bound).all()), f"off by up to {worst:.2f} x {ulps} ulps"


def assert_matches_reference(got: torch.Tensor, block: Block) -> None:
    expected = per_layer_input_projection_reference(*block.args())
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        return
    assert_within_ulps(got, expected, block.summed_magnitude(), 2)
    assert (got == expected).float().mean() >= 0.9  # bit flips are the exception, not the rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "hidden_size", "ple_dim", "strided"),
    # 1 row: the vector kernels; more: the tile kernels (rows padded to 16 or 32)
    [(1, 64, 32, False), (1, 96, 24, True), (3, 96, 32, True), (17, 96, 32, False), (5, 80, 24, True)],
)
def test_matches_reference(rows: int, hidden_size: int, ple_dim: int, strided: bool, dtype: torch.dtype) -> None:
    block = Block(rows, hidden_size, ple_dim, dtype, strided, seed=rows)
    assert_matches_reference(per_layer_input_projection(*block.args(), use_triton=True), block)


@pytest.mark.parametrize("rows", [1, 3])
def test_gate_with_several_weight_blocks_per_split(rows: int) -> None:
    """Small gate tiles, so each K-chunk spans several weight blocks (the first loaded before the chained
    wait, each next one while the current multiplies) and the last chunk runs past hidden_size (masked)."""
    tiles = ProjectionTiles(gate_block_p=16, gate_block_k=16, splits=2, project_block_n=16)
    block = Block(rows, 80, 24, torch.float32, strided=True, seed=rows)  # 5 blocks of 16: chunks of 48 and 32
    assert_matches_reference(per_layer_input_projection(*block.args(), use_triton=True, tiles=tiles), block)


def test_calls_in_a_row_reset_the_gate_tickets() -> None:
    """The tile gate kernel counts finished K-chunks per block; each call must leave the counts at zero, or
    the next call (another layer, another batch size) would sum its partials too early or never."""
    first = Block(17, 96, 32, torch.float32, strided=False, seed=1)
    second = Block(3, 80, 24, torch.float32, strided=True, seed=2)
    results = [per_layer_input_projection(*b.args(), use_triton=True) for b in (first, second, first)]
    assert torch.equal(results[0], results[2])
    assert_matches_reference(results[1], second)
    assert pending_tickets("ple_gate") == 0


def test_forced_above_max_rows() -> None:
    """use_triton=True past MAX_ROWS: more than one block of rows per grid."""
    block = Block(MAX_ROWS + 8, 64, 32, torch.bfloat16, strided=True, seed=7)
    assert_matches_reference(per_layer_input_projection(*block.args(), use_triton=True), block)


def test_zero_rows_and_bad_shapes() -> None:
    block = Block(0, 64, 32, torch.float32, strided=False, seed=0)
    assert per_layer_input_projection(*block.args(), use_triton=True).shape == (0, 64)
    block = Block(2, 64, 32, torch.float32, strided=False, seed=0)
    with pytest.raises(ValueError, match="projection_weight"):
        per_layer_input_projection(block.hidden, block.per_layer_input, block.gate_weight, block.gate_weight)
    with pytest.raises(ValueError, match="mixed dtypes"):
        per_layer_input_projection(
            block.hidden, block.per_layer_input.bfloat16(), block.gate_weight, block.projection_weight
        )


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU default is the torch reference")
def test_cpu_default_is_the_reference() -> None:
    block = Block(3, 64, 32, torch.bfloat16, strided=True, seed=3)
    assert torch.equal(per_layer_input_projection(*block.args()), per_layer_input_projection_reference(*block.args()))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_gpu_e4b_sizes_bf16(rows: int) -> None:
    block = Block(rows, 2560, 256, torch.bfloat16, strided=True, seed=rows)
    got = per_layer_input_projection(*block.args())
    assert_matches_reference(got, block)
    # the last K-chunk to finish sums the partials, always in split order: deterministic
    assert torch.equal(got, per_layer_input_projection(*block.args()))


@pytest.mark.gpu
def test_gpu_default_above_max_rows_is_cublas_around_the_fused_gelu() -> None:
    block = Block(MAX_ROWS + 1, 2560, 256, torch.bfloat16, strided=True, seed=5)
    hidden, per_layer_input, gate_weight, projection_weight = block.args()
    expected = F.linear(gelu_tanh_mul(F.linear(hidden, gate_weight), per_layer_input), projection_weight)
    assert torch.equal(per_layer_input_projection(*block.args()), expected)
    assert_matches_reference(per_layer_input_projection(*block.args()), block)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_gpu_cuda_graph_replays_new_inputs(rows: int) -> None:
    block = Block(rows, 2560, 256, torch.bfloat16, strided=True, seed=9)
    per_layer_input_projection(*block.args())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = per_layer_input_projection(*block.args())
    for seed in (10, 11, 12):  # each replay must find the gate kernel's tickets reset by the one before
        fresh = Block(rows, 2560, 256, torch.bfloat16, strided=True, seed=seed)
        block.hidden.copy_(fresh.hidden)  # new inputs in place: the replay must read them
        block.per_layer_input.copy_(fresh.per_layer_input)
        graph.replay()
        torch.cuda.synchronize()
        # within 2 ulps; the share of bit-exact outputs varies with the inputs (a flipped gated value moves
        # every output), so only the bound is asserted here
        expected = per_layer_input_projection_reference(*block.args())
        assert_within_ulps(out, expected, block.summed_magnitude(), 2)
