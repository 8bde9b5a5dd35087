"""kernels/decode_gemm.py: the chained Triton GEMM of decode-sized projections against cuBLAS (Hopper only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.kernels.decode_gemm import GATED, decode_gelu_mlp, decode_gemm_applies, decode_linear
from srt.kernels.gelu_mul import gelu_tanh_mul_packed


def test_never_applies_off_cuda() -> None:
    x, weight = torch.randn(4, 256).bfloat16(), torch.randn(256, 512).bfloat16().t()
    assert not any(decode_gemm_applies(x, weight, splits) for splits in (1, 4, GATED))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_decode_linear_matches_cublas(rows: int) -> None:
    """The chained Triton GEMM against F.linear, at E4B's gate_up shape (one chunk, bf16 out; and with gelu * up
    in its epilogue), its o and qkv shapes (four float32 partial sums) and down's, inside a CUDA graph behind a
    kernel that writes its input."""
    if not decode_gemm_applies(
        torch.empty(1, 2560, device="cuda").bfloat16(),
        torch.empty(256, 2560, device="cuda").bfloat16().t().contiguous().t(),
        1,
    ):
        pytest.skip("needs TMA (Hopper) and Triton's tensor descriptors")
    for n, k, splits in ((20480, 2560, 1), (20480, 2560, GATED), (2560, 2048, 4), (3072, 2560, 4), (2560, 10240, 4)):
        x = torch.randn(rows, k, device="cuda").bfloat16()
        weight = (torch.randn(k, n, device="cuda") / 50).bfloat16().t()
        assert decode_gemm_applies(x, weight, splits)
        source = torch.zeros_like(x)

        def run(splits=splits, weight=weight, source=source) -> torch.Tensor:
            # the multiply: a kernel ahead writes the input
            if splits == GATED:
                return decode_gelu_mlp(source * 1, weight)
            return decode_linear(source * 1, weight, splits)

        run()  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        source.copy_(x)
        graph.replay()
        product = F.linear(x, weight)
        if splits == GATED:  # the same rounded products go into the same gelu * up math
            assert out.dtype == torch.bfloat16
            expected = gelu_tanh_mul_packed(product).float()
            got = out.float()
        else:
            expected = product.float()
            got = out.float() if splits == 1 else out.sum(0)
            assert out.dtype == (torch.bfloat16 if splits == 1 else torch.float32)
        error = (got - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, (n, k, splits, error)
