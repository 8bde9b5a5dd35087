"""RoPE tables: the Triton kernel against the torch ops, for both of Gemma 4's layer types.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 from conftest); the `gpu` test runs
E4B's real head sizes on the device.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4TextConfig

pytest.importorskip("triton")

from srt.layers.rotary import RotaryEmbedding  # noqa: E402


def _rotary(head_dim: int, global_head_dim: int) -> RotaryEmbedding:
    config = Gemma4TextConfig(
        hidden_size=64, head_dim=head_dim, global_head_dim=global_head_dim, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return RotaryEmbedding(config)


def _check(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, same_bits: float = 0.0) -> None:
    """Kernel vs torch ops within a last-bit difference of cos/sin; at least `same_bits` of the values equal
    (the interpreter's numpy cos differs from torch's more often than the GPU's libdevice does)."""
    for layer_type in rotary.layer_types:
        want = rotary.cos_sin(positions, layer_type, dtype, use_triton=False)
        got = rotary.cos_sin(positions, layer_type, dtype, use_triton=True)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == dtype
            # float32 cos/sin of one float32 argument: the libraries may differ in the last bit, which can move
            # a rounded bf16 value by one ulp
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6 if dtype == torch.float32 else 2**-8)
            assert (g == w).float().mean() >= same_bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_ops(dtype: torch.dtype) -> None:
    rotary = _rotary(16, 32)
    positions = torch.tensor([0, 1, 7, 512, 4095, 130000])
    _check(rotary, positions, dtype)
    cos, sin = rotary.cos_sin(positions[:0], "full_attention", dtype, use_triton=True)
    assert cos.shape == sin.shape == (0, 32)


@pytest.mark.gpu
def test_kernel_on_gpu_at_e4b_sizes() -> None:
    _check(_rotary(256, 512), torch.arange(0, 131072, 97, device="cuda"), torch.bfloat16, same_bits=0.99)
