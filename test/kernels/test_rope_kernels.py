"""kernels/rope.py: the RoPE tables and the heads' RMSNorm + RoPE kernel against their torch references.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 from conftest); the `gpu` tests run
E4B's real head sizes on the device. The tables come from transformers' own Gemma 4 rotary module through
`RotaryEmbedding`, for both layer types.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, EPS, assert_within_ulps, cos_sin, projection_heads, random_weight
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, apply_rotary_pos_emb

from srt.kernels.norm import rms_norm_reference, sum_partials
from srt.kernels.rope import HeadTiling, apply_rotary, head_tiling, rms_norm_rope, rms_norm_rope_reference
from srt.layers.rotary import RotaryEmbedding

# ---------------------------------------------------------------------------------------------------------
# cos / sin tables


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
def test_tables_match_the_torch_ops(dtype: torch.dtype) -> None:
    rotary = _rotary(16, 32)
    positions = torch.tensor([0, 1, 7, 512, 4095, 130000])
    _check(rotary, positions, dtype)
    cos, sin = rotary.cos_sin(positions[:0], "full_attention", dtype, use_triton=True)
    assert cos.shape == sin.shape == (0, 32)


@pytest.mark.gpu
def test_tables_on_gpu_at_e4b_sizes() -> None:
    _check(_rotary(256, 512), torch.arange(0, 131072, 97, device="cuda"), torch.bfloat16, same_bits=0.99)


# ---------------------------------------------------------------------------------------------------------
# RMSNorm + RoPE of attention heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_reference_is_transformers_norm_then_rope(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, heads, dim = 5, 3, 32
    x = projection_heads(tokens, heads, dim, dtype, strided=True, generator=generator)
    cos, sin = cos_sin(tokens, dim, dtype)
    norm = Gemma4RMSNorm(dim, eps=EPS)
    norm.weight.data = random_weight(dim, generator)
    norm = norm.to(DEVICE, dtype)
    with torch.no_grad():
        expected = apply_rotary_pos_emb(norm(x), cos, sin, unsqueeze_dim=1)
        assert torch.equal(rms_norm_rope_reference(x, norm.weight, cos, sin, EPS), expected)
        scale_free = Gemma4RMSNorm(dim, eps=EPS, with_scale=False)
        expected = apply_rotary_pos_emb(scale_free(x), cos, sin, unsqueeze_dim=1)
        assert torch.equal(rms_norm_rope_reference(x, None, cos, sin, EPS), expected)
        assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1))


@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 2, 32), (7, 4, 64)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_tokens", [None, 4], ids=["per-token", "tiles-of-4"])  # 1, 3, 7 tokens: tails
def test_rms_norm_rope_kernel(
    shape: tuple[int, int, int], with_weight: bool, strided: bool, dtype: torch.dtype, block_tokens: int | None
) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    tokens, heads, dim = shape
    x = projection_heads(tokens, heads, dim, dtype, strided, generator)
    weight = random_weight(dim, generator).to(DEVICE, dtype) if with_weight else None
    cos, sin = cos_sin(tokens, dim, dtype)
    got = rms_norm_rope(x, weight, cos, sin, EPS, use_triton=True, block_tokens=block_tokens)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    expected = rms_norm_rope_reference(x, weight, cos, sin, EPS)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    # the float32 RoPE of the same rounded norm output, rounded once: what the kernel computes
    y = rms_norm_reference(x, weight, EPS)
    y32, cos32, sin32 = y.float(), cos.float()[:, None], sin.float()[:, None]
    rotated = torch.cat((-y32[..., dim // 2 :], y32[..., : dim // 2]), dim=-1)
    oracle = (y32 * cos32 + rotated * sin32).to(dtype)
    magnitude = (y32 * cos32).abs() + (rotated * sin32).abs()
    assert_within_ulps(got, oracle, magnitude, 1)
    assert (got == oracle).float().mean() >= 0.95
    # torch's op-by-op bf16 rounds y*cos, rotated*sin and their sum: a couple of ulps from the single rounding
    assert_within_ulps(got, expected, magnitude, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_tokens", [None, 4], ids=["per-token", "tiles-of-4"])
def test_rms_norm_rope_of_split_k_partials(dtype: torch.dtype, block_tokens: int | None) -> None:
    """x as float32 K-split partial sums [splits, tokens, heads, dim] (the chained decode GEMM's output): summed
    in split order and rounded to cos's dtype, then normed and roped as the rounded projection would be."""
    generator = torch.Generator().manual_seed(5)
    partials = torch.randn(3, 6, 2, 32, generator=generator).to(DEVICE)
    weight = random_weight(32, generator).to(DEVICE, dtype)
    cos, sin = cos_sin(6, 32, dtype)
    x = sum_partials(partials, dtype)
    got = rms_norm_rope(partials, weight, cos, sin, EPS, use_triton=True, block_tokens=block_tokens)
    want = rms_norm_rope(x, weight, cos, sin, EPS, use_triton=True, block_tokens=block_tokens)
    assert got.dtype == dtype and torch.equal(got, want)
    reference = rms_norm_rope(partials.cpu(), weight.cpu(), cos.cpu(), sin.cpu(), EPS)  # the CPU default
    assert torch.equal(reference, rms_norm_rope_reference(x.cpu(), weight.cpu(), cos.cpu(), sin.cpu(), EPS))
    with pytest.raises(ValueError, match="float32"):
        rms_norm_rope(partials.bfloat16(), weight, cos, sin, EPS)


def test_head_tiling_blocks_tokens_at_prefill_only() -> None:
    """One token per program (1-4 warps, as decode always ran) until a call has 512 tokens; then tiles that
    keep >= 256 token blocks per head, up to 4096 values: E4B's 8192-token prefill gets 16 tokens of a
    256-wide head (8 warps), 8 of a 512-wide one."""
    assert head_tiling(1, 256) == HeadTiling(1, 2) and head_tiling(32, 512) == HeadTiling(1, 4)
    assert head_tiling(511, 256) == HeadTiling(1, 2)
    assert head_tiling(512, 256) == HeadTiling(2, 4)
    assert head_tiling(2100, 256) == HeadTiling(8, 8)
    assert head_tiling(8192, 256) == HeadTiling(16, 8) and head_tiling(8192, 512) == HeadTiling(8, 8)
    assert head_tiling(5, 16, block_tokens=4) == HeadTiling(4, 1)
    with pytest.raises(ValueError, match="power of two"):
        head_tiling(5, 16, block_tokens=6)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [256, 512])
def test_rms_norm_rope_tiles_on_gpu_at_prefill_sizes(dim: int) -> None:
    """E4B's q of KV-shared layers at a prefill size: tiles (a tail of 4 tokens) give what per-token programs
    give, both within the single rounding of the float32 oracle."""
    generator = torch.Generator().manual_seed(dim)
    x = projection_heads(2100, 8, dim, torch.bfloat16, strided=True, generator=generator)
    weight = random_weight(dim, generator).to(DEVICE, torch.bfloat16)
    cos, sin = cos_sin(2100, dim, torch.bfloat16)
    tiled = rms_norm_rope(x, weight, cos, sin, EPS, use_triton=True)
    per_token = rms_norm_rope(x, weight, cos, sin, EPS, use_triton=True, block_tokens=1)
    expected = rms_norm_rope_reference(x, weight, cos, sin, EPS)
    y32 = rms_norm_reference(x, weight, EPS).float()
    rotated = torch.cat((-y32[..., dim // 2 :], y32[..., : dim // 2]), dim=-1)
    magnitude = (y32 * cos.float()[:, None]).abs() + (rotated * sin.float()[:, None]).abs()
    # float32 noise (the tiles reduce in another order) may flip a bf16 rounding of the norm between the two
    assert_within_ulps(tiled, per_token, magnitude, 2)
    assert (tiled == per_token).float().mean() >= 0.99
    assert_within_ulps(tiled, expected, magnitude, 2)


def test_zero_tokens() -> None:
    cos, sin = cos_sin(0, 16, torch.float32)
    assert rms_norm_rope(torch.empty(0, 2, 16, device=DEVICE), None, cos, sin, EPS, use_triton=True).shape == (0, 2, 16)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU default is the torch reference")
def test_cpu_default_is_the_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 16, generator=generator)
    weight = random_weight(16, generator)
    cos, sin = cos_sin(3, 16, torch.float32)
    assert torch.equal(rms_norm_rope(x, weight, cos, sin, EPS), rms_norm_rope_reference(x, weight, cos, sin, EPS))
