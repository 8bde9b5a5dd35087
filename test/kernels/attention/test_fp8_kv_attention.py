"""FP8 KV (`--kv-cache-dtype fp8_e4m3`): the extend and decode kernels over float8_e4m3fn buffers with per-tensor
scales against the `torch_native` reference over the same buffers (which dequantizes element by element), and
the reference's error against unquantized KV.

The scales differ per layer and between K and V, so a kernel that skips one, applies K's to V, or reads a
KV-shared layer's scales from anywhere but its owner's (layers 2 and 3 read layers 0 and 1) is visibly wrong.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_attention_kernels import (
    BF16_TOL,
    DEVICE,
    GQA,
    WINDOW,
    PagedState,
    compare_backends,
    make_layers,
    requires_cuda,
)

from srt.forward.forward_batch import ForwardMode
from srt.kernels.kv_quant import FP8_KV_DTYPE
from srt.layers.attention import create_attention_backend, triton_backend
from srt.mem_cache.kv_cache_dtype import KVScales

SCALES = {0: KVScales(0.5, 2.0), 1: KVScales(0.125, 0.25)}
# fp32 queries over the same FP8 values: the kernels scale scores and outputs where the reference scales each
# element, otherwise the same sums
FP8_FP32_TOL = 1e-4


def fp8_state(sliding_kv: int, full_kv: int, window: int, scales=SCALES) -> PagedState:
    return PagedState(make_layers(sliding_kv, full_kv, window=window), FP8_KV_DTYPE, scales=scales)


def decode_batch(state: PagedState, lengths: list[int], window: int):
    rows = [state.add_request(n) for n in lengths]
    for row, n in zip(rows, lengths, strict=True):
        state.free_outside_window(row, max(n + 1 - window, 0))
    out_loc = torch.cat([state.new_slots(row, 1) for row in rows])
    return state.batch(ForwardMode.DECODE, rows, [1] * len(rows), out_loc)


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_fp8_extend_matches_torch_native(sliding_kv: int, full_kv: int, window: int) -> None:
    torch.manual_seed(10)
    state = fp8_state(sliding_kv, full_kv, window)
    fresh, hit = state.add_request(0), state.add_request(14)
    state.free_outside_window(hit, max(14 - window + 1, 0))
    out_loc = torch.cat([state.new_slots(fresh, 21), state.new_slots(hit, 6)])
    batch = state.batch(ForwardMode.EXTEND, [fresh, hit], [21, 6], out_loc)
    errors = compare_backends(state, batch)
    assert max(errors) < FP8_FP32_TOL, errors
    state.pool.check_integrity()
    state.check_integrity()


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_fp8_decode_with_split_kv_matches_torch_native(sliding_kv: int, full_kv: int, window: int) -> None:
    torch.manual_seed(11)
    state = fp8_state(sliding_kv, full_kv, window)
    batch = decode_batch(state, [70, 5, 33], window)
    errors = compare_backends(state, batch)
    assert max(errors) < FP8_FP32_TOL, errors
    state.pool.check_integrity()


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_fp8_verify_rows_match_torch_native(
    sliding_kv: int, full_kv: int, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify step (a request's rows together, `kernels/attention/verify.py`) over FP8 K/V."""
    monkeypatch.setattr(triton_backend, "VERIFY_KERNEL_MIN_REQUESTS", 1)
    torch.manual_seed(12)
    state = fp8_state(sliding_kv, full_kv, window)
    lengths, counts = [70, 5, 33], [4, 1, 4]
    rows = [state.add_request(n) for n in lengths]
    for row, n in zip(rows, lengths, strict=True):
        state.free_outside_window(row, max(n + 1 - window, 0))
    out_loc = torch.cat([state.new_slots(row, n) for row, n in zip(rows, counts, strict=True)])
    batch = state.batch(ForwardMode.EXTEND, rows, counts, out_loc)
    batch.verify_rows = max(counts)
    errors = compare_backends(state, batch)
    assert max(errors) < FP8_FP32_TOL, errors
    state.pool.check_integrity()


@pytest.mark.parametrize("mode", ["decode", "extend", "verify"])
def test_fp8_kv_with_bf16_queries_matches_torch_native(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 queries over FP8 K/V: the kernels multiply in float16 (e4m3 widens to it in one instruction on sm90,
    `triton_support.fp8_dot_dtype`), within bf16's tolerance of the float32 reference over the same FP8 values."""
    monkeypatch.setattr(triton_backend, "VERIFY_KERNEL_MIN_REQUESTS", 1)
    torch.manual_seed(15)
    state = fp8_state(2, 1, WINDOW)
    if mode == "decode":
        batch = decode_batch(state, [70, 5, 33], WINDOW)
    else:
        lengths, counts = [40, 9], [4, 3]
        rows = [state.add_request(n) for n in lengths]
        out_loc = torch.cat([state.new_slots(row, n) for row, n in zip(rows, counts, strict=True)])
        batch = state.batch(ForwardMode.EXTEND, rows, counts, out_loc)
        batch.verify_rows = max(counts) if mode == "verify" else None
    errors = compare_backends(state, batch, dtype=torch.bfloat16)
    assert max(errors) < BF16_TOL, errors
    state.pool.check_integrity()


def test_fp8_kv_saturates_queries_beyond_float16() -> None:
    """A bf16 query element beyond float16's range (1e6) saturates at 65504 in the float16 operand instead of
    turning the scores into inf - inf = NaN: the output stays finite and within bf16's tolerance of the reference
    over the saturated query. (Not the reference over 1e6 itself: where two keys' first elements are one e4m3 step
    apart, the two scales can weigh them differently; the GPU's random values did, 0.29 off, H100, 2026-11-27.)"""
    torch.manual_seed(16)
    state = fp8_state(2, 1, WINDOW)
    batch = decode_batch(state, [20, 9], WINDOW)
    reference, kernels = create_attention_backend("torch_native"), create_attention_backend("triton")
    ref_batch, kernel_batch = dataclasses.replace(batch), dataclasses.replace(batch)
    reference.init_forward_metadata(ref_batch)
    kernels.init_forward_metadata(kernel_batch)
    spec = state.layers[1]
    q = torch.randn(batch.num_tokens, spec.num_heads, spec.head_dim, device=DEVICE, dtype=torch.bfloat16) / 8
    q[:, :, 0] = 1e6
    got = kernels.forward(q, spec, kernel_batch)
    assert torch.isfinite(got).all()
    expected = reference.forward(q.float().clamp(-65504.0, 65504.0), spec, ref_batch)
    assert float((got.float() - expected).abs().max()) < BF16_TOL * float(expected.abs().max())


def test_fp8_kv_error_against_unquantized_kv_is_bounded() -> None:
    """The same K/V (N(0, 1)) stored in float32 and in FP8 (scale 1, as without checkpoint scales), scores of unit
    size (q / sqrt(head_dim)): e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4), so attention
    outputs of unit-size values move by a few hundredths. Bound: 0.1."""
    outputs = {}
    for dtype in (torch.float32, FP8_KV_DTYPE):
        torch.manual_seed(12)
        state = PagedState(make_layers(2, 1), dtype)
        batch = decode_batch(state, [40, 9], WINDOW)
        reference = create_attention_backend("torch_native")
        reference.init_forward_metadata(batch)
        torch.manual_seed(13)
        q = torch.randn(batch.num_tokens, 4, 64, device=DEVICE) / 8
        outputs[dtype] = reference.forward(q, state.layers[1], batch)
    error = float((outputs[FP8_KV_DTYPE] - outputs[torch.float32]).abs().max())
    print(f"fp8 vs fp32 KV, attention output max abs error: {error:.4f}")
    assert 0 < error < 0.1


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads,sliding_kv,full_kv", [(8, 2, 2), (32, 16, 4), (16, 8, 2)])
def test_fp8_gemma4_shapes_match_the_reference(heads: int, sliding_kv: int, full_kv: int) -> None:
    """E4B, 31B and 26B heads at head_dim 256 / 512 with bf16 queries over FP8 K/V."""
    torch.manual_seed(14)
    layers = make_layers(sliding_kv, full_kv, heads, dims=(256, 512), window=512)
    state = PagedState(layers, FP8_KV_DTYPE, full_size=8192, swa_size=8192, scales=SCALES)
    fresh, hit = state.add_request(0), state.add_request(700)
    state.free_outside_window(hit, 700 - 512 + 1)
    out_loc = torch.cat([state.new_slots(fresh, 1000), state.new_slots(hit, 300)])
    batch = state.batch(ForwardMode.EXTEND, [fresh, hit], [1000, 300], out_loc)
    errors = compare_backends(state, dataclasses.replace(batch), dtype=torch.bfloat16)
    assert max(errors) < 2e-2, errors
    decode = decode_batch(state, [1500, 37, 3000], 512)
    errors = compare_backends(state, decode, dtype=torch.bfloat16)
    assert max(errors) < 2e-2, errors
    state.check_integrity()
