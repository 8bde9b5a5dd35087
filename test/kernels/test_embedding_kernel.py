"""kernels/embedding.py: the scaled embedding lookup kernel against F.embedding times the rounded scale.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 from conftest); the `gpu` test runs
E4B's tied, transposed table on the device.
"""

from __future__ import annotations

import pytest
import torch

from srt.kernels.embedding import scaled_embedding, scaled_embedding_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_matches_the_reference(dtype: torch.dtype, transposed: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 300, generator=generator).to(dtype)
    if transposed:  # srt's tied embedding: a view of its contiguous transpose
        weight = weight.t().contiguous().t()
    ids = torch.tensor([[3, 39, 0], [3, 17, 8]])
    got = scaled_embedding(weight, ids, 300**0.5, use_triton=True)
    want = scaled_embedding_reference(weight, ids, 300**0.5)
    assert got.shape == (2, 3, 300) and got.dtype == dtype
    assert torch.equal(got, want)  # one multiply, rounded once, either way
    assert scaled_embedding(weight, ids[:, :0], 2.0, use_triton=True).shape == (2, 0, 300)


@pytest.mark.gpu
def test_kernel_on_gpu_at_e4b_size() -> None:
    weight = torch.randn(2560, 262144, device="cuda").bfloat16().t()
    ids = torch.randint(0, 262144, (32,), device="cuda")
    assert torch.equal(scaled_embedding(weight, ids, 2560**0.5), scaled_embedding_reference(weight, ids, 2560**0.5))
