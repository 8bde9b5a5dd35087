"""A decoder layer's elementwise kernels at E4B sizes in bf16, captured in one CUDA graph and replayed on new
inputs (GPU only)."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, EPS, cos_sin, projection_heads, random_weight

from srt.kernels.gelu_mul import gelu_tanh_mul_packed, gelu_tanh_mul_reference
from srt.kernels.norm import add_rms_norm, add_rms_norm_reference
from srt.kernels.rope import rms_norm_rope, rms_norm_rope_reference


@pytest.mark.gpu
def test_gpu_real_sizes_bf16_under_a_cuda_graph() -> None:
    """E4B-like sizes (head_dim 512, hidden 2560, intermediate 10240) in bf16, captured once and replayed."""
    generator = torch.Generator().manual_seed(4)
    tokens, heads, dim, hidden, n = 4, 8, 512, 2560, 10240
    bf16 = torch.bfloat16
    x = projection_heads(tokens, heads, dim, bf16, strided=True, generator=generator)
    head_weight = random_weight(dim, generator).to(DEVICE, bf16)
    cos, sin = cos_sin(tokens, dim, bf16)
    attn = (3 * torch.randn(tokens, hidden, generator=generator)).to(DEVICE, bf16)
    residual = torch.randn(tokens, hidden, generator=generator).to(DEVICE, bf16)
    weight = random_weight(hidden, generator).to(DEVICE, bf16)
    scale = torch.tensor([0.37], device=DEVICE, dtype=bf16)
    gate_up = (3 * torch.randn(tokens, 2 * n, generator=generator)).to(DEVICE, bf16)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            rms_norm_rope(x, head_weight, cos, sin, EPS),
            add_rms_norm(attn, residual, weight, EPS, scale),
            gelu_tanh_mul_packed(gate_up),
        )

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for source in (x, attn, gate_up):  # new inputs in place: the replay must read them
        source.copy_(torch.randn(source.shape, generator=generator).to(DEVICE, bf16) * 3)
    graph.replay()
    torch.cuda.synchronize()
    rope, added, gated = outs
    torch.testing.assert_close(
        rope.float(), rms_norm_rope_reference(x, head_weight, cos, sin, EPS).float(), rtol=2**-6, atol=2**-6
    )
    torch.testing.assert_close(
        added.float(), add_rms_norm_reference(attn, residual, weight, EPS, scale).float(), rtol=2**-7, atol=2**-7
    )
    expected = gelu_tanh_mul_reference(*gate_up.chunk(2, dim=-1)).float()
    torch.testing.assert_close(gated.float(), expected, rtol=2**-7, atol=1e-3)
