"""The fused Triton RMSNorm against the torch reference (Triton's interpreter on CPU, the real kernel on GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from srt.layers.layernorm import RMSNorm  # noqa: E402
from srt.layers.rms_norm_kernel import fused_rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32), (1, 100), (0, 64)])
@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_reference(shape: tuple[int, ...], with_scale: bool, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-6, with_scale=with_scale)
    if with_scale:
        norm.weight.data = 1 + 0.3 * torch.randn(shape[-1], generator=generator)
    norm = norm.to(device=DEVICE, dtype=dtype)
    x = (3 * torch.randn(shape, generator=generator)).to(device=DEVICE, dtype=dtype)
    expected = norm.reference(x)
    got = fused_rms_norm(x, norm.weight if with_scale else None, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # both round the same float32 value to bf16; rsqrt vs pow may flip the last bit
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_non_contiguous_rows() -> None:
    x = torch.randn(6, 2, 64, device=DEVICE)[:, 1]  # a strided view, as per-layer inputs are sliced
    torch.testing.assert_close(fused_rms_norm(x, None, 1e-6), RMSNorm(64, with_scale=False).reference(x))
