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

from srt.kernels.norm import sum_partials
from srt.kernels.qkv_store import QKVLayout, qkv_norm_rope_store, qkv_norm_rope_store_reference


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
    layout: QKVLayout, tokens: int, dtype: torch.dtype, sliding: bool, use_triton: bool | None, splits: int = 0
):
    """(kernel's q, target), (reference's q, target); with `splits`, the kernel reads the projection as that
    many float32 partial sums and the reference their rounded sum."""
    generator = torch.Generator().manual_seed(tokens + layout.head_dim)
    if splits:
        qkv = torch.randn(splits, tokens, sum(layout.sizes), generator=generator).to(DEVICE)
        want_qkv = sum_partials(qkv, dtype)
    else:
        qkv = want_qkv = (3 * torch.randn(tokens, sum(layout.sizes), generator=generator)).to(DEVICE, dtype)
    norms = _norms(layout.head_dim, generator)
    cos, sin = _cos_sin(tokens, layout.head_dim, dtype)
    slots = torch.randperm(17, generator=generator)[:tokens].to(DEVICE) + 1
    got_target, want_target = _target(19, layout, dtype, sliding), _target(19, layout, dtype, sliding)
    with torch.no_grad():  # as the model runs
        got = qkv_norm_rope_store(qkv, layout, *norms, cos, sin, *got_target, slots, use_triton=use_triton)
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
def test_kernel_matches_the_op_by_op_path(dtype: torch.dtype, sliding: bool, k_eq_v: bool) -> None:
    layout = QKVLayout(num_heads=4, num_kv_heads=2, head_dim=16, k_eq_v=k_eq_v)
    (q, target), (want_q, want_target) = _run_both(layout, 5, dtype, sliding, use_triton=True)
    _assert_close(q, want_q)
    # every buffer row, written or not: untouched rows keep their fill
    _assert_close(target.k_buffer, want_target.k_buffer)
    _assert_close(target.v_buffer, want_target.v_buffer)
    assert (target.k_buffer != 7.0).any(dim=(1, 2)).sum() == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_triton", [True, False])
def test_partial_sums_of_the_projection(dtype: torch.dtype, use_triton: bool) -> None:
    """The chained decode GEMM hands over float32 K-chunk partial sums: summed in split order and rounded to the
    activation dtype, they give what the rounded projection gives (kernel and CPU path)."""
    layout = QKVLayout(num_heads=4, num_kv_heads=2, head_dim=16, k_eq_v=False)
    (q, target), (want_q, want_target) = _run_both(layout, 5, dtype, True, use_triton, splits=3)
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
@pytest.mark.parametrize("tokens", [1, 17])
def test_kernel_on_gpu_at_real_sizes(layout: QKVLayout, tokens: int) -> None:
    for sliding in (False, True):
        (q, target), (want_q, want_target) = _run_both(layout, tokens, torch.bfloat16, sliding, use_triton=True)
        _assert_close(q, want_q)
        _assert_close(target.k_buffer, want_target.k_buffer)
        _assert_close(target.v_buffer, want_target.v_buffer)
