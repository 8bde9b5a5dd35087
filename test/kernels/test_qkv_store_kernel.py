"""The fused q/k/v norm + RoPE + K/V store kernel against its op-by-op reference.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 from conftest) at tiny sizes; the
`gpu` test runs Gemma 4 E4B and 31B layer sizes. The kernel rounds where the reference rounds (see
kernels/rope.py), so float32 agrees to float32 noise and bf16 to a bf16 ulp now and then.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from kernel_inputs import DEVICE, EPS, random_weight
from kernel_inputs import cos_sin as _cos_sin

from srt.kernels.kv_quant import FP8_KV_DTYPE
from srt.kernels.norm import sum_partials
from srt.kernels.qkv_store import QKVLayout, qkv_norm_rope_store, qkv_norm_rope_store_reference
from srt.kernels.triton_support import jit, round_to_e4m3, tl


class Target(NamedTuple):
    """A layer's K/V buffers and, on sliding layers, its full -> SWA slot table: the kernel's last inputs."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    full_to_swa: torch.Tensor | None


def _norms(dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """q and k norm weights and the norms' eps (v's norm is scale-free)."""
    return random_weight(dim, generator).to(DEVICE), random_weight(dim, generator).to(DEVICE), EPS


def _target(rows: int, layout: QKVLayout, dtype: torch.dtype, sliding: bool) -> Target:
    shape = (rows, layout.num_kv_heads, layout.head_dim)
    # a recognisable fill, so that a write to the wrong row shows
    k_buffer = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
    v_buffer = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)
    # full slot s -> SWA row (s * 5) % rows, a permutation that is not the identity
    full_to_swa = (torch.arange(rows, device=DEVICE) * 5) % rows if sliding else None
    return Target(k_buffer, v_buffer, full_to_swa)


def _run_both(
    layout: QKVLayout,
    tokens: int,
    dtype: torch.dtype,
    sliding: bool,
    use_triton: bool | None,
    splits: int = 0,
    block_tokens: int | None = None,
):
    """(kernel's q, target), (reference's q, target); with `splits`, the kernel reads the projection as that
    many float32 partial sums and the reference their rounded sum. `block_tokens`: the kernel's tokens per
    program (None: its choice by token count, one at these sizes)."""
    generator = torch.Generator().manual_seed(tokens + layout.head_dim)
    if splits:
        qkv = torch.randn(splits, tokens, sum(layout.sizes), generator=generator).to(DEVICE)
        want_qkv = sum_partials(qkv, dtype)
    else:
        qkv = want_qkv = (3 * torch.randn(tokens, sum(layout.sizes), generator=generator)).to(DEVICE, dtype)
    norms = _norms(layout.head_dim, generator)
    cos, sin = _cos_sin(tokens, layout.head_dim, dtype)
    # rows 1.., never 0: a masked tail token whose slot loads as 0 must not write row 0
    slots = torch.randperm(tokens + 12, generator=generator)[:tokens].to(DEVICE) + 1
    rows = tokens + 14
    got_target, want_target = _target(rows, layout, dtype, sliding), _target(rows, layout, dtype, sliding)
    with torch.no_grad():  # as the model runs
        got = qkv_norm_rope_store(
            qkv, layout, *norms, cos, sin, *got_target, slots, use_triton=use_triton, block_tokens=block_tokens
        )
        want = qkv_norm_rope_store_reference(want_qkv, layout, *norms, cos, sin, *want_target, slots)
    return (got, got_target), (want, want_target)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # The reference rounds y * cos, rotate(y) * sin and their sum each to bf16, the kernel rounds once
        # from float32: they differ by up to a couple of ulps of those terms, whose size is that of the
        # largest values, not of an output where the two terms cancel (seen on the H100 at 31B's size).
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-6 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("k_eq_v", [False, True])
@pytest.mark.parametrize(
    "tokens,block_tokens",
    [(5, None), (5, 4), (8, 4), (3, 8)],
    ids=["one-per-program", "tiles-with-a-tail", "whole-tiles", "one-partial-tile"],
)
def test_kernel_matches_the_op_by_op_path(
    dtype: torch.dtype, sliding: bool, k_eq_v: bool, tokens: int, block_tokens: int | None
) -> None:
    layout = QKVLayout(num_heads=4, num_kv_heads=2, head_dim=16, k_eq_v=k_eq_v)
    (q, target), (want_q, want_target) = _run_both(layout, tokens, dtype, sliding, True, block_tokens=block_tokens)
    _assert_close(q, want_q)
    # every buffer row, written or not: untouched rows keep their fill
    _assert_close(target.k_buffer, want_target.k_buffer)
    _assert_close(target.v_buffer, want_target.v_buffer)
    assert (target.k_buffer != 7.0).any(dim=(1, 2)).sum() == tokens
    assert (target.v_buffer != -7.0).any(dim=(1, 2)).sum() == tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_triton,block_tokens", [(True, None), (True, 4), (False, None)])
def test_partial_sums_of_the_projection(dtype: torch.dtype, use_triton: bool, block_tokens: int | None) -> None:
    """The chained decode GEMM hands over float32 K-chunk partial sums: summed in split order and rounded to the
    activation dtype, they give what the rounded projection gives (kernel, per token or in tiles, and CPU path)."""
    layout = QKVLayout(num_heads=4, num_kv_heads=2, head_dim=16, k_eq_v=False)
    (q, target), (want_q, want_target) = _run_both(layout, 5, dtype, True, use_triton, 3, block_tokens)
    assert q.dtype == dtype
    _assert_close(q, want_q)
    _assert_close(target.k_buffer, want_target.k_buffer)
    _assert_close(target.v_buffer, want_target.v_buffer)


def test_no_tokens_writes_nothing() -> None:
    layout = QKVLayout(num_heads=2, num_kv_heads=1, head_dim=16, k_eq_v=False)
    target = _target(4, layout, torch.float32, sliding=False)
    cos, sin = _cos_sin(0, 16, torch.float32)
    qkv = torch.empty(0, sum(layout.sizes), device=DEVICE)
    q = qkv_norm_rope_store(
        qkv,
        layout,
        *_norms(16, torch.Generator()),
        cos,
        sin,
        *target,
        torch.empty(0, dtype=torch.int64, device=DEVICE),
        use_triton=True,
    )
    assert q.shape == (0, 2, 16) and bool((target.k_buffer == 7.0).all())


def test_wrong_width_is_refused() -> None:
    layout = QKVLayout(num_heads=2, num_kv_heads=1, head_dim=16, k_eq_v=False)
    with pytest.raises(ValueError, match="columns"):
        qkv_norm_rope_store(
            torch.zeros(1, 40),
            layout,
            *_norms(16, torch.Generator()),
            *_cos_sin(1, 16, torch.float32),
            *_target(2, layout, torch.float32, False),
            torch.ones(1, dtype=torch.int64),
        )


def test_buffers_the_kernel_cannot_write_safely_are_refused() -> None:
    layout = QKVLayout(num_heads=2, num_kv_heads=1, head_dim=16, k_eq_v=False)
    qkv = torch.zeros(2, sum(layout.sizes), device=DEVICE)
    args = (*_cos_sin(2, 16, torch.float32),)
    slots = torch.tensor([1, 2], device=DEVICE)
    norms = _norms(16, torch.Generator())
    wrong_heads = _target(4, QKVLayout(2, 2, 16, False), torch.float32, sliding=False)
    with pytest.raises(ValueError, match="do not hold"):
        qkv_norm_rope_store(qkv, layout, *norms, *args, *wrong_heads, slots, use_triton=True)
    target = _target(4, layout, torch.float32, sliding=False)
    with pytest.raises(ValueError, match="one contiguous slot per token"):
        qkv_norm_rope_store(qkv, layout, *norms, *args, *target, slots[:1], use_triton=True)
    with pytest.raises(ValueError, match="power of two"):
        qkv_norm_rope_store(qkv, layout, *norms, *args, *target, slots, use_triton=True, block_tokens=3)
    assert bool((target.k_buffer == 7.0).all())  # nothing was written


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU default path")
def test_cpu_default_is_the_reference() -> None:
    layout = QKVLayout(num_heads=4, num_kv_heads=2, head_dim=16, k_eq_v=False)
    (q, target), (want_q, want_target) = _run_both(layout, 3, torch.bfloat16, True, use_triton=None)
    assert torch.equal(q, want_q) and torch.equal(target.k_buffer, want_target.k_buffer)
    assert torch.equal(target.v_buffer, want_target.v_buffer)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout",
    [
        QKVLayout(num_heads=8, num_kv_heads=2, head_dim=256, k_eq_v=False),  # E4B sliding
        QKVLayout(num_heads=8, num_kv_heads=2, head_dim=512, k_eq_v=False),  # E4B full
        QKVLayout(num_heads=32, num_kv_heads=4, head_dim=512, k_eq_v=True),  # 31B full
    ],
)
@pytest.mark.parametrize("tokens", [1, 17, 2100])  # 2100: prefill tiles of 8 tokens, a tail of 4
def test_kernel_on_gpu_at_real_sizes(layout: QKVLayout, tokens: int) -> None:
    for sliding in (False, True):
        (q, target), (want_q, want_target) = _run_both(layout, tokens, torch.bfloat16, sliding, use_triton=True)
        _assert_close(q, want_q)
        _assert_close(target.k_buffer, want_target.k_buffer)
        _assert_close(target.v_buffer, want_target.v_buffer)


# ---- FP8 K/V buffers (--kv-cache-dtype fp8_e4m3) ----


def _fp8_target(rows: int, layout: QKVLayout, sliding: bool) -> Target:
    shape = (rows, layout.num_kv_heads, layout.head_dim)
    k_buffer = torch.full(shape, 7.0, device=DEVICE).to(FP8_KV_DTYPE)
    v_buffer = torch.full(shape, -7.0, device=DEVICE).to(FP8_KV_DTYPE)
    full_to_swa = (torch.arange(rows, device=DEVICE) * 5) % rows if sliding else None
    return Target(k_buffer, v_buffer, full_to_swa)


@pytest.mark.parametrize(
    "dtype,sliding,k_eq_v,head_dim,block_tokens",
    [
        (torch.float32, False, False, 16, None),
        (torch.bfloat16, True, True, 16, None),
        (torch.bfloat16, True, False, 16, 4),  # tiles of 4 tokens, a tail of 1
        pytest.param(torch.bfloat16, True, False, 256, None, marks=pytest.mark.gpu),  # E4B sliding
        pytest.param(torch.bfloat16, False, True, 512, None, marks=pytest.mark.gpu),  # 31B full
        pytest.param(torch.bfloat16, True, False, 256, 16, marks=pytest.mark.gpu),  # E4B sliding prefill tiles
    ],
)
def test_fp8_store_matches_the_reference_quantization(
    dtype: torch.dtype, sliding: bool, k_eq_v: bool, head_dim: int, block_tokens: int | None
) -> None:
    """The kernel stores clamp(value / scale, +-448) as float8_e4m3fn: the reference's FP8 bytes, up to one FP8
    step where the two unquantized values differ in their last bit (RoPE's single rounding, kernels/rope.py).
    k_scale 1/256 pushes some K values past 448 (saturated, not inf/NaN); v_scale 0.5 differs from it."""
    layout = QKVLayout(num_heads=4, num_kv_heads=2, head_dim=head_dim, k_eq_v=k_eq_v)
    generator = torch.Generator().manual_seed(40)
    qkv = (3 * torch.randn(5, sum(layout.sizes), generator=generator)).to(DEVICE, dtype)
    norms = _norms(layout.head_dim, generator)
    cos, sin = _cos_sin(5, layout.head_dim, dtype)
    slots = torch.tensor([3, 1, 8, 2, 11], device=DEVICE)
    scales = {"k_scale": 1 / 256, "v_scale": 0.5}
    got, want = _fp8_target(13, layout, sliding), _fp8_target(13, layout, sliding)
    with torch.no_grad():
        q = qkv_norm_rope_store(
            qkv, layout, *norms, cos, sin, *got, slots, use_triton=True, block_tokens=block_tokens, **scales
        )
        want_q = qkv_norm_rope_store_reference(qkv, layout, *norms, cos, sin, *want, slots, **scales)
    _assert_close(q, want_q)
    for name, scale in (("k_buffer", scales["k_scale"]), ("v_buffer", scales["v_scale"])):
        ours, ref = getattr(got, name).float() * scale, getattr(want, name).float() * scale  # dequantized
        assert torch.isfinite(ours).all()
        # one e4m3 step (3 mantissa bits), over _assert_close's bf16 allowance for RoPE's rounding
        torch.testing.assert_close(ours, ref, rtol=2**-3, atol=2**-6 * float(ref.abs().max()), msg=name)
        assert (ours == ref).float().mean() > 0.9, f"{name}: most bytes are the reference's"
    assert float(got.k_buffer.float().abs().max()) == 448.0  # saturated at e4m3fn's largest value
    assert (got.k_buffer.float() != 7.0).any(dim=(1, 2)).sum() == 5


def test_e4m3_rounding_is_torchs_on_every_value_and_midpoint() -> None:
    """`round_to_e4m3` (integer ops, so the interpreter rounds as the GPU does) gives torch's float8_e4m3fn cast
    on every finite e4m3 value, every midpoint between neighbours (ties to even), just off each midpoint, and
    random values across the range, subnormals and signed zeros included."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    generator = torch.Generator().manual_seed(41)
    x = torch.cat(
        [
            values,
            mids,
            torch.nextafter(mids, torch.tensor(1e9)),
            torch.nextafter(mids, torch.tensor(-1e9)),
            torch.randn(1024, generator=generator) * 50,
            torch.randn(1024, generator=generator) * 0.01,
            torch.tensor([0.0, -0.0]),
        ]
    ).clamp(-448, 448)
    x = torch.cat([x, torch.zeros(4096 - x.numel())]).to(DEVICE)
    got = torch.empty(4096, dtype=FP8_KV_DTYPE, device=DEVICE)
    _round_to_e4m3_kernel[(1,)](x, got, N=4096)
    assert torch.equal(got.view(torch.uint8), x.to(FP8_KV_DTYPE).view(torch.uint8))


@jit
def _round_to_e4m3_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, round_to_e4m3(tl.load(x_ptr + offs)).to(out_ptr.dtype.element_ty))
