"""The fused decoder-layer kernels against their torch references and against the modules the model uses today.

On the CPU the Triton path runs under Triton's interpreter (`use_triton=True`, TRITON_INTERPRET=1 from
conftest), so shapes stay tiny; the `gpu` test runs real Gemma 4 sizes and a CUDA graph replay.

bf16 checks are in ulps of the magnitudes that get rounded: the kernels round where torch rounds except for
RoPE, which rounds once from float32 (see srt/layers/fused_kernels.py), and float32 noise (summation order,
exp vs tanh) may flip a rounded bf16 bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from srt.layers.decode_gemm import GATED, decode_gelu_mlp, decode_gemm_applies, decode_linear  # noqa: E402
from srt.layers.fused_kernels import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_then_norm,
    rms_norm_rope,
    rms_norm_rope_reference,
    sum_partials,
)
from srt.layers.gelu_kernels import gelu_tanh_mul, gelu_tanh_mul_packed, gelu_tanh_mul_reference  # noqa: E402
from srt.layers.layernorm import RMSNorm  # noqa: E402
from srt.layers.logits_processor import softcap_logits, softcap_logits_reference  # noqa: E402
from srt.layers.rotary import apply_rotary  # noqa: E402
from srt.layers.split_k import TRITON_SPLITS, linear_partials  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def bf16_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values (8 significant bits) at |magnitude|, elementwise, in float32."""
    exponent = torch.floor(torch.log2(magnitude.float().abs().clamp_min(2.0**-120)))
    return torch.pow(2.0, exponent - 7)


def assert_within_ulps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, ulps: float) -> None:
    """|got - expected| <= ulps bf16 ulps of `magnitude` (the size of what was rounded), elementwise."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    error = (got.float() - expected.float()).abs()
    bound = ulps * bf16_ulp(magnitude)
    worst = (error / bound).max().item() if error.numel() else 0.0
    assert bool((error <= bound).all()), f"off by up to {worst:.2f} x {ulps} ulps"


def random_weight(dim: int, generator: torch.Generator) -> torch.Tensor:
    return 1 + 0.3 * torch.randn(dim, generator=generator)


def cos_sin(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default-RoPE tables as RotaryEmbedding.cos_sin builds them, at scattered positions."""
    positions = torch.arange(tokens, dtype=torch.float32) * 37 + 5
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def projection_heads(
    tokens: int, heads: int, dim: int, dtype: torch.dtype, strided: bool, generator: torch.Generator
) -> torch.Tensor:
    """[tokens, heads, dim]; `strided`: the k part of a fused q/k/v GEMM output viewed per head, as the model does."""
    if not strided:
        return (3 * torch.randn(tokens, heads, dim, generator=generator)).to(DEVICE, dtype)
    qkv = (3 * torch.randn(tokens, (2 * heads + 1) * dim, generator=generator)).to(DEVICE, dtype)
    _, k, _ = qkv.split([heads * dim, heads * dim, dim], dim=-1)
    x = k.view(tokens, heads, dim)
    assert x.storage_offset() == heads * dim  # an offset view with row stride (2 * heads + 1) * dim
    return x


# ---------------------------------------------------------------------------------------------------------
# rms_norm_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_reference_is_rmsnorm_then_apply_rotary(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, heads, dim = 5, 3, 32
    x = projection_heads(tokens, heads, dim, dtype, strided=True, generator=generator)
    cos, sin = cos_sin(tokens, dim, dtype)
    norm = RMSNorm(dim, eps=EPS)
    norm.weight.data = random_weight(dim, generator)
    norm = norm.to(DEVICE, dtype)
    scale_free = RMSNorm(dim, eps=EPS, with_scale=False)
    with torch.no_grad():
        assert torch.equal(
            rms_norm_rope_reference(x, norm.weight, cos, sin, EPS), apply_rotary(norm.reference(x), cos, sin)
        )
        assert torch.equal(
            rms_norm_rope_reference(x, None, cos, sin, EPS), apply_rotary(scale_free.reference(x), cos, sin)
        )
        if DEVICE == "cpu":  # the module's forward is the reference there
            assert torch.equal(rms_norm_rope_reference(x, norm.weight, cos, sin, EPS), apply_rotary(norm(x), cos, sin))


@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 2, 32), (7, 4, 64)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_kernel(
    shape: tuple[int, int, int], with_weight: bool, strided: bool, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    tokens, heads, dim = shape
    x = projection_heads(tokens, heads, dim, dtype, strided, generator)
    weight = random_weight(dim, generator).to(DEVICE, dtype) if with_weight else None
    cos, sin = cos_sin(tokens, dim, dtype)
    got = rms_norm_rope(x, weight, cos, sin, EPS, use_triton=True)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    expected = rms_norm_rope_reference(x, weight, cos, sin, EPS)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    # the float32 RoPE of the same rounded norm output, rounded once: what the kernel computes
    norm = RMSNorm(dim, eps=EPS, with_scale=with_weight)
    if with_weight:
        norm.weight.data = weight
    y = norm.reference(x).detach()
    y32, cos32, sin32 = y.float(), cos.float()[:, None], sin.float()[:, None]
    rotated = torch.cat((-y32[..., dim // 2 :], y32[..., : dim // 2]), dim=-1)
    oracle = (y32 * cos32 + rotated * sin32).to(dtype)
    magnitude = (y32 * cos32).abs() + (rotated * sin32).abs()
    assert_within_ulps(got, oracle, magnitude, 1)
    assert (got == oracle).float().mean() >= 0.95
    # torch's op-by-op bf16 rounds y*cos, rotated*sin and their sum: a couple of ulps from the single rounding
    assert_within_ulps(got, expected, magnitude, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_of_split_k_partials(dtype: torch.dtype) -> None:
    """x as float32 K-split partial sums [splits, tokens, heads, dim] (the chained decode GEMM's output): summed
    in split order and rounded to cos's dtype, then normed and roped as the rounded projection would be."""
    generator = torch.Generator().manual_seed(5)
    partials = torch.randn(3, 4, 2, 32, generator=generator).to(DEVICE)
    weight = random_weight(32, generator).to(DEVICE, dtype)
    cos, sin = cos_sin(4, 32, dtype)
    x = sum_partials(partials, dtype)
    got = rms_norm_rope(partials, weight, cos, sin, EPS, use_triton=True)
    assert got.dtype == dtype and torch.equal(got, rms_norm_rope(x, weight, cos, sin, EPS, use_triton=True))
    reference = rms_norm_rope(partials.cpu(), weight.cpu(), cos.cpu(), sin.cpu(), EPS)  # the CPU default
    assert torch.equal(reference, rms_norm_rope_reference(x.cpu(), weight.cpu(), cos.cpu(), sin.cpu(), EPS))
    with pytest.raises(ValueError, match="float32"):
        rms_norm_rope(partials.bfloat16(), weight, cos, sin, EPS)


# ---------------------------------------------------------------------------------------------------------
# add_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_reference_is_residual_plus_rmsnorm_times_scale(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = 96
    x = (3 * torch.randn(4, hidden, generator=generator)).to(DEVICE, dtype)
    residual = torch.randn(4, hidden, generator=generator).to(DEVICE, dtype)
    norm = RMSNorm(hidden, eps=EPS)
    norm.weight.data = random_weight(hidden, generator)
    norm = norm.to(DEVICE, dtype)
    scale = torch.tensor([0.37], device=DEVICE).to(dtype)  # the layer scalar buffer, in the model's dtype
    with torch.no_grad():
        normed = norm(x) if DEVICE == "cpu" else norm.reference(x)
        assert torch.equal(add_rms_norm_reference(x, residual, norm.weight, EPS, scale), (residual + normed) * scale)
        assert torch.equal(add_rms_norm_reference(x, residual, norm.weight, EPS), residual + normed)
        scale_free = RMSNorm(hidden, eps=EPS, with_scale=False)
        assert torch.equal(add_rms_norm_reference(x, residual, None, EPS), residual + scale_free.reference(x))


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_kernel(tokens: int, hidden: int, with_weight: bool, with_scale: bool, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(tokens * hidden)
    # x as a column slice of a wider output (row stride 2 * hidden), the residual contiguous
    x = (3 * torch.randn(tokens, 2 * hidden, generator=generator)).to(DEVICE, dtype)[:, hidden:]
    residual = torch.randn(tokens, hidden, generator=generator).to(DEVICE, dtype)
    weight = random_weight(hidden, generator).to(DEVICE, dtype) if with_weight else None
    scale = torch.tensor([0.37], device=DEVICE).to(dtype) if with_scale else None
    got = add_rms_norm(x, residual, weight, EPS, scale, use_triton=True)
    assert got.shape == residual.shape and got.dtype == dtype
    expected = add_rms_norm_reference(x, residual, weight, EPS, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    # rounding as torch rounds: bit-equal unless float32 noise flips a rounded bit of the norm
    normed = RMSNorm(hidden, eps=EPS, with_scale=False).reference(x).float() * (1 if weight is None else weight.float())
    magnitude = (residual.float().abs() + normed.abs()) * (1 if scale is None else scale.float().abs())
    assert_within_ulps(got, expected, magnitude, 1)
    assert (got == expected).float().mean() > 0.9


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_then_norm_kernel(dtype: torch.dtype, with_scale: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    hidden = 96
    x = (3 * torch.randn(3, hidden, generator=generator)).to(DEVICE, dtype)
    residual = torch.randn(3, hidden, generator=generator).to(DEVICE, dtype)
    weight, next_weight = (random_weight(hidden, generator).to(DEVICE, dtype) for _ in range(2))
    scale = torch.tensor([0.37], device=DEVICE).to(dtype) if with_scale else None
    summed, normed = add_rms_norm_then_norm(x, residual, weight, EPS, next_weight, 1e-5, scale, use_triton=True)
    assert torch.equal(summed, add_rms_norm(x, residual, weight, EPS, scale, use_triton=True))
    next_norm = RMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    next_norm.weight.data = next_weight
    with torch.no_grad():
        expected = next_norm.reference(summed)
    if dtype == torch.float32:
        torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)
    else:  # the same rounded sum goes in; float32 noise may flip the last bit of the rounded output
        assert_within_ulps(normed, expected, expected, 1)
        assert (normed == expected).float().mean() > 0.9
    # the reference path (the CPU default) returns the reference pair
    cpu = [t.cpu() if t is not None else None for t in (x, residual, weight, next_weight, scale)]
    ref_summed, ref_normed = add_rms_norm_then_norm(cpu[0], cpu[1], cpu[2], EPS, cpu[3], 1e-5, cpu[4])
    assert torch.equal(ref_summed, add_rms_norm_reference(cpu[0], cpu[1], cpu[2], EPS, cpu[4]))
    assert torch.equal(ref_normed, next_norm.cpu().reference(ref_summed))


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_of_split_k_partials(splits: int, dtype: torch.dtype) -> None:
    """x as float32 K-split partial sums [splits, tokens, hidden] (`split_k.linear_partials`): the kernel and
    the reference both sum them in split order and round to the dtype, then add + norm as for a plain x."""
    generator = torch.Generator().manual_seed(splits)
    tokens, hidden = 3, 96
    partials = (2 * torch.randn(splits, tokens, hidden, generator=generator)).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=generator).to(DEVICE, dtype)
    weight, next_weight = (random_weight(hidden, generator).to(DEVICE, dtype) for _ in range(2))
    x = sum_partials(partials, dtype)
    assert torch.equal(x, (partials[0] + partials[1] + (partials[2] if splits == 3 else 0)).to(dtype))
    expected = add_rms_norm_then_norm(x, residual, weight, EPS, next_weight, EPS, use_triton=True)
    got = add_rms_norm_then_norm(partials, residual, weight, EPS, next_weight, EPS, use_triton=True)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and torch.equal(g, e)  # the same rounded x goes in, so the same values come out
    reference = add_rms_norm(partials.cpu(), residual.cpu(), weight.cpu(), EPS)  # the CPU default
    assert torch.equal(reference, add_rms_norm_reference(x.cpu(), residual.cpu(), weight.cpu(), EPS))
    with pytest.raises(ValueError, match="x torch.bfloat16"):  # partials are float32
        add_rms_norm(partials.bfloat16(), residual, weight, EPS)


def test_linear_partials_off_cuda_is_the_plain_product() -> None:
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    assert torch.equal(linear_partials(x, weight.t().contiguous().t()), F.linear(x, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_linear_partials_on_gpu_sum_to_the_product(rows: int) -> None:
    x = torch.randn(rows, 10240, device="cuda").bfloat16()
    weight = (torch.randn(10240, 2560, device="cuda") / 100).bfloat16().t()  # stored transposed, as the model's
    expected = F.linear(x, weight).float()
    for splits in (None, 2):  # srt's choice (the chained Triton GEMM on Hopper), and cuBLAS's batched GEMM
        partials = linear_partials(x, weight, splits)
        chunks = TRITON_SPLITS if splits is None and decode_gemm_applies(x, weight, TRITON_SPLITS) else 2
        assert partials.shape == (chunks, rows, 2560) and partials.dtype == torch.float32
        error = (sum_partials(partials, torch.bfloat16).float() - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, error  # within a bf16 rounding step of the largest output


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


def test_add_rms_norm_float32_scale_keeps_the_dtype() -> None:
    x, residual = (torch.randn(2, 64, device=DEVICE).bfloat16() for _ in range(2))
    scale = torch.tensor([0.5], device=DEVICE)  # float32: scaling by a power of two is exact either way
    normed = RMSNorm(64, with_scale=False).reference(x)
    expected = add_rms_norm_reference(x, residual, None, EPS, scale)
    assert torch.equal(expected, ((residual + normed) * scale).bfloat16())
    got = add_rms_norm(x, residual, None, EPS, scale, use_triton=True)
    assert got.dtype == torch.bfloat16
    assert_within_ulps(got, expected, (residual.float().abs() + normed.float().abs()) * 0.5, 1)


# ---------------------------------------------------------------------------------------------------------
# gelu_tanh_mul


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("layout", ["packed", "halves", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_kernel(tokens: int, layout: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(tokens)
    n = 48
    gate_up = (3 * torch.randn(tokens, 2 * n, generator=generator)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    if layout == "packed":
        got = gelu_tanh_mul_packed(gate_up, use_triton=True)
    elif layout == "halves":  # row stride 2n, no copy
        got = gelu_tanh_mul(gate, up, use_triton=True)
    else:
        got = gelu_tanh_mul(gate.contiguous(), up.contiguous(), use_triton=True)
    assert got.shape == (tokens, n) and got.dtype == dtype
    expected = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(gelu_tanh_mul_reference(gate, up), expected)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    # float64 gelu in the cancellation-free form, rounded where torch rounds: what the kernel computes
    g64 = gate.double()
    gelu64 = g64 * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64**3))
    oracle = (gelu64.to(dtype).float() * up.float()).to(dtype)
    magnitude = gelu64.abs() * up.double().abs()
    assert_within_ulps(got, oracle, magnitude, 1)
    assert (got == oracle).float().mean() >= 0.95
    # torch's 0.5 * g * (1 + tanh) cancels for negative g: allow its float32 error (~2^-23 of |g * up|)
    error = (got.float() - expected.float()).abs()
    assert bool((error <= bf16_ulp(magnitude) + (gate.float() * up.float()).abs() * 2.0**-22).all())


# ---------------------------------------------------------------------------------------------------------
# every op: empty batches, the CPU default


def test_zero_tokens() -> None:
    cos, sin = cos_sin(0, 16, torch.float32)
    assert rms_norm_rope(torch.empty(0, 2, 16, device=DEVICE), None, cos, sin, EPS, use_triton=True).shape == (0, 2, 16)
    empty = torch.empty(0, 64, device=DEVICE)
    assert add_rms_norm(empty, empty, None, EPS, torch.ones(1, device=DEVICE), use_triton=True).shape == (0, 64)
    assert gelu_tanh_mul_packed(torch.empty(0, 96, device=DEVICE), use_triton=True).shape == (0, 48)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU default is the torch reference")
def test_cpu_default_is_the_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 16, generator=generator)
    weight = random_weight(16, generator)
    cos, sin = cos_sin(3, 16, torch.float32)
    assert torch.equal(rms_norm_rope(x, weight, cos, sin, EPS), rms_norm_rope_reference(x, weight, cos, sin, EPS))
    rows, residual, scale = x.view(3, 32), torch.randn(3, 32, generator=generator), torch.tensor([0.3])
    assert torch.equal(
        add_rms_norm(rows, residual, None, EPS, scale), add_rms_norm_reference(rows, residual, None, EPS, scale)
    )
    assert torch.equal(gelu_tanh_mul_packed(rows), gelu_tanh_mul_reference(*rows.chunk(2, dim=-1)))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_logits_matches_torch(dtype: torch.dtype) -> None:
    """The one-pass softcap (tanh from exp, Taylor series near 0) against torch.tanh, over small to huge logits."""
    logits = torch.cat([torch.randn(3, 1000) * scale for scale in (1e-3, 1.0, 30.0, 1e4)], dim=1).to(DEVICE, dtype)
    got = softcap_logits(logits, 30.0, use_triton=True)
    expected = softcap_logits_reference(logits, 30.0)
    assert got.logits.dtype == torch.float32 and got.greedy_ids is None
    torch.testing.assert_close(got.logits, expected, rtol=2e-6, atol=2e-6)


def test_softcap_argmax_is_torch_argmax_of_the_softcapped_logits() -> None:
    """The argmax found by the softcap pass: a vocabulary of two blocks and a bit (4096 each), ties at the row's
    maximum in one block and across blocks (the lowest id wins, as in torch.argmax), a NaN (it wins, as in
    torch.argmax), a row of equal values, and logits large enough that distinct raw values cap to one."""
    vocab = 2 * 4096 + 10
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, [17, 4095, 4096, 8200]] = 50.0
    logits[2, 8195] = float("nan")
    logits[2, 3] = 100.0
    logits[3] = 1.0
    logits[4, [5000, 6000]] = torch.tensor([1000.0, 2000.0])  # both cap to 30.0 in float32
    got = softcap_logits(logits.to(DEVICE), 30.0, use_triton=True, with_argmax=True)
    torch.testing.assert_close(
        got.logits.cpu(), softcap_logits_reference(logits, 30.0), rtol=2e-6, atol=2e-6, equal_nan=True
    )
    expected = torch.argmax(got.logits.cpu(), dim=-1)
    assert got.greedy_ids.dtype == torch.int64
    assert got.greedy_ids.cpu().tolist() == expected.tolist()
    assert expected[1:].tolist() == [17, 8195, 0, 5000]
