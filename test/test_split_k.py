"""`split_k.linear_partials`: K-split float32 partial sums of a decode projection, Triton kernel and cuBLAS paths.

On the CPU the Triton kernel runs under Triton's interpreter (TRITON_INTERPRET=1 from conftest) at small
sizes; the `gpu` tests run E4B's down projection shape and a CUDA graph replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from srt.layers.fused_kernels import sum_partials  # noqa: E402
from srt.layers.split_k import SplitKTiles, linear_partials, tuned_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def transposed_weight(n: int, k: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """An nn.Linear weight [n, k] stored as the model stores it: a view of a contiguous [k, n]."""
    return (torch.randn(k, n, generator=generator) / k**0.5).to(DEVICE, dtype).t()


def test_linear_partials_off_cuda_is_the_plain_product() -> None:
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    assert torch.equal(linear_partials(x, weight.t().contiguous().t()), F.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("tiles", [SplitKTiles(16, 16, 1, 4), SplitKTiles(32, 16, 2, 4)])
def test_triton_partials_are_the_chunk_products(rows: int, tiles: SplitKTiles) -> None:
    """Split s of the kernel's output is x[:, chunk s] @ W^T[chunk s] in float32, for bf16 operands (products
    exact in float32: only the summation order differs) and float32 ones."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 64, 64
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
        weight = transposed_weight(n, k, dtype, generator)
        partials = linear_partials(x, weight, tiles, use_triton=True)
        splits = tiles.splits(k)
        assert partials.shape == (splits, rows, n) and partials.dtype == torch.float32
        chunk = k // splits
        chunks = [slice(s * chunk, (s + 1) * chunk) for s in range(splits)]
        expected = torch.stack([x[:, c].float() @ weight.t()[c].float() for c in chunks])
        torch.testing.assert_close(partials, expected, rtol=1e-5, atol=1e-5)


def test_triton_partials_take_strided_rows() -> None:
    """x may be a row-strided view (e.g. the attention output reshaped); rows beyond `rows` are not written."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=generator).to(DEVICE)[:, :64]
    weight = transposed_weight(32, 64, torch.float32, generator)
    partials = linear_partials(x, weight, SplitKTiles(16, 32, 1, 4), use_triton=True)
    torch.testing.assert_close(partials.sum(0), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_triton_partials_reject_tiles_that_do_not_fit() -> None:
    x = torch.randn(2, 48, device=DEVICE)
    weight = transposed_weight(32, 48, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="do not fit"):
        linear_partials(x, weight, SplitKTiles(16, 32, 1, 4), use_triton=True)  # 48 is not a multiple of 32


def test_tuned_tiles_cover_e4b_attention_and_mlp_projections() -> None:
    for n, k in ((2560, 2048), (2560, 4096), (2560, 10240)):
        tiles = tuned_tiles(n, k)
        assert tiles is None or (n % tiles.block_n == 0 and tiles.splits(k) * tiles.block_k * tiles.steps == k)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("use_triton", [False, None])
def test_linear_partials_on_gpu_sum_to_the_product(rows: int, use_triton: bool | None) -> None:
    x = torch.randn(rows, 10240, device="cuda").bfloat16()
    weight = (torch.randn(10240, 2560, device="cuda") / 100).bfloat16().t()  # stored transposed, as the model's
    partials = linear_partials(x, weight, use_triton=use_triton)
    assert partials.dim() == 3 and partials.shape[1:] == (rows, 2560) and partials.dtype == torch.float32
    expected = F.linear(x, weight).float()
    error = (sum_partials(partials, torch.bfloat16).float() - expected).abs().max() / expected.abs().max()
    assert error < 1e-2, error  # within a bf16 rounding step of the largest output


@pytest.mark.gpu
def test_triton_partials_replay_in_a_cuda_graph() -> None:
    x = torch.randn(32, 2048, device="cuda").bfloat16()
    weight = (torch.randn(2048, 2560, device="cuda") / 50).bfloat16().t()
    tiles = tuned_tiles(2560, 2048) or SplitKTiles(64, 256, 1, 4)
    eager = linear_partials(x, weight, tiles, use_triton=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear_partials(x, weight, tiles, use_triton=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, linear_partials(x, weight, tiles, use_triton=True))
    assert not torch.equal(captured, eager)
