"""kernels/norm.py: the RMSNorm and residual add + norm kernels against their torch references.

On the CPU the Triton path runs under Triton's interpreter (`use_triton=True`, TRITON_INTERPRET=1 from
conftest), so shapes stay tiny; on a GPU the real kernels run.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, EPS, assert_within_ulps, random_weight

from srt.kernels.norm import (
    PREFILL_ROWS,
    MoeNorms,
    ThenAdd,
    add_norm_warps,
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_then_moe_norms,
    add_rms_norm_then_norm,
    moe_outputs_add_then_norm,
    rms_norm,
    rms_norm_reference,
    sum_partials,
)
from srt.layers.layernorm import RMSNorm


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32), (1, 100), (0, 64)])
@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_matches_the_reference(shape: tuple[int, ...], with_scale: bool, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = random_weight(shape[-1], generator).to(DEVICE, dtype) if with_scale else None
    x = (3 * torch.randn(shape, generator=generator)).to(device=DEVICE, dtype=dtype)
    expected = rms_norm_reference(x, weight, EPS)
    got = rms_norm(x, weight, EPS, use_triton=True)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # both round the same float32 value to bf16; rsqrt vs pow may flip the last bit
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_rms_norm_of_non_contiguous_rows() -> None:
    x = torch.randn(6, 2, 64, device=DEVICE)[:, 1]  # a strided view, as per-layer inputs are sliced
    torch.testing.assert_close(rms_norm(x, None, EPS, use_triton=True), rms_norm_reference(x, None, EPS))


def test_rmsnorm_module_is_the_reference_on_the_cpu() -> None:
    norm = RMSNorm(64, eps=EPS)
    norm.weight.data = random_weight(64, torch.Generator().manual_seed(1))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, EPS))
        assert torch.equal(norm.reference(x), rms_norm_reference(x, norm.weight, EPS))
    scale_free = RMSNorm(64, eps=EPS, with_scale=False)
    assert scale_free.scale is None and torch.equal(scale_free(x), rms_norm_reference(x, None, EPS))


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


@pytest.mark.parametrize("partials", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_then_moe_norms_kernel(dtype: torch.dtype, partials: bool) -> None:
    """An MoE layer's norms of the residual add (the dense MLP's, the experts' and the router's input) from one
    kernel: the sum and the next norm as `add_rms_norm_then_norm` gives them, the experts' input as its RMSNorm,
    the router's as `Router`'s ops (scale-free norm, * scale, * scalar; each rounded), within a rounding step."""
    from srt.layers.moe.router import Router

    generator = torch.Generator().manual_seed(5)
    tokens, hidden = 3, 96
    shape = (2, tokens, hidden) if partials else (tokens, hidden)
    x = (3 * torch.randn(shape, generator=generator)).to(DEVICE, torch.float32 if partials else dtype)
    residual = torch.randn(tokens, hidden, generator=generator).to(DEVICE, dtype)
    weight, next_weight, expert_weight = (random_weight(hidden, generator).to(DEVICE, dtype) for _ in range(3))
    router = Router(hidden, num_experts=4, top_k=2, eps=EPS).to(DEVICE, dtype)
    router.scale.data = random_weight(hidden, generator).to(DEVICE, dtype)
    moe = MoeNorms(expert_weight, *router.input_norms())
    summed, normed, expert, routed = add_rms_norm_then_moe_norms(
        x, residual, weight, EPS, next_weight, EPS, moe, use_triton=True
    )
    expected_pair = add_rms_norm_then_norm(x, residual, weight, EPS, next_weight, EPS, use_triton=True)
    assert torch.equal(summed, expected_pair[0]) and torch.equal(normed, expected_pair[1])
    with torch.no_grad():
        expected = (
            rms_norm_reference(summed, expert_weight, EPS),
            router.norm.reference(summed) * router.scale * router.scalar_root_size,
        )
    for got, want in zip((expert, routed), expected, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the same rounded sum goes in; float32 noise may flip the last bit of a rounded step
            assert_within_ulps(got, want, want, 2)
            assert (got == want).float().mean() > 0.9
    # the reference path (the CPU default) returns the module ops' values exactly
    cpu = [t.cpu() for t in (x, residual, weight, next_weight, expert_weight, router.scale)]
    reference = add_rms_norm_then_moe_norms(
        cpu[0], cpu[1], cpu[2], EPS, cpu[3], EPS, MoeNorms(cpu[4], cpu[5], router.scalar_root_size)
    )
    with torch.no_grad():
        router_cpu = router.cpu()
        assert torch.equal(
            reference[3], router_cpu.norm.reference(reference[0]) * router_cpu.scale * router_cpu.scalar_root_size
        )
    assert torch.equal(reference[2], rms_norm_reference(reference[0], cpu[4], EPS))


@pytest.mark.parametrize(("num_parts", "partials", "with_next"), [(8, True, True), (8, True, False), (1, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_outputs_add_then_norm(dtype: torch.dtype, num_parts: int, partials: bool, with_next: bool) -> None:
    """An MoE layer's end in one kernel: the expert slots summed as torch sums them and normed, the dense MLP's
    output (or its K-split partials) normed and added to that, the sum normed and added to the residual with the
    layer scalar, then the next norm: the values of the add + norm kernels run one after the other."""
    generator = torch.Generator().manual_seed(11 + num_parts)
    tokens, hidden = 3, 96
    shape = (2, tokens, hidden) if partials else (tokens, hidden)
    x = (3 * torch.randn(shape, generator=generator)).to(DEVICE, torch.float32 if partials else dtype)
    parts = torch.randn(tokens, num_parts, hidden, generator=generator).to(DEVICE, dtype)
    residual = (2 * torch.randn(tokens, hidden, generator=generator)).to(DEVICE, dtype)
    weight, parts_weight, post_weight, next_weight = (
        random_weight(hidden, generator).to(DEVICE, dtype) for _ in range(4)
    )
    scale = torch.tensor([0.75], device=DEVICE, dtype=dtype) if with_next else None
    then_add = ThenAdd(residual, post_weight, 2e-6)
    got, got_next = moe_outputs_add_then_norm(
        x, weight, EPS, parts, parts_weight, 1e-5, then_add, next_weight if with_next else None, 3e-6, scale,
        use_triton=True,
    )  # fmt: skip
    normed_parts = rms_norm_reference(parts.sum(dim=1), parts_weight, 1e-5)  # (the interpreter's casts truncate)
    mlp_out = add_rms_norm(x, normed_parts, weight, EPS, use_triton=True)
    expected, expected_next = add_rms_norm_then_norm(
        mlp_out, residual, post_weight, 2e-6, next_weight, 3e-6, scale, use_triton=True
    )
    assert got.dtype == dtype and got.shape == (tokens, hidden) and (got_next is not None) == with_next
    pairs = [(got, expected)] + ([(got_next, expected_next)] if with_next else [])
    for value, oracle in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(value, oracle, rtol=1e-5, atol=1e-5)
        else:  # float32 summation order and 1/sqrt noise may flip the last bit of a rounded step
            assert_within_ulps(value, oracle, oracle.abs() + residual.float().abs(), 2)
            assert (value == oracle).float().mean() > 0.9
    cpu = [t.cpu() if t is not None else None for t in (x, parts, weight, parts_weight, residual, post_weight,
                                                         next_weight, scale)]  # fmt: skip
    reference, reference_next = moe_outputs_add_then_norm(
        cpu[0], cpu[2], EPS, cpu[1], cpu[3], 1e-5, ThenAdd(cpu[4], cpu[5], 2e-6), cpu[6], 3e-6, cpu[7]
    )  # the reference path: torch's ops exactly
    summed_x = sum_partials(cpu[0], dtype) if partials else cpu[0]
    inner = add_rms_norm_reference(summed_x, rms_norm_reference(cpu[1].sum(dim=1), cpu[3], 1e-5), cpu[2], EPS)
    assert torch.equal(reference, add_rms_norm_reference(inner, cpu[4], cpu[5], 2e-6, cpu[7]))
    assert torch.equal(reference_next, rms_norm_reference(reference, cpu[6], 3e-6))
    with pytest.raises(ValueError, match="residual"):
        moe_outputs_add_then_norm(
            x, weight, EPS, parts, parts_weight, 1e-5, ThenAdd(residual[:2], post_weight, 1e-6), None, 0.0
        )
    with pytest.raises(ValueError, match="parts"):
        moe_outputs_add_then_norm(x, weight, EPS, parts[:, 0], parts_weight, 1e-5, then_add, None, 0.0)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_of_split_k_partials(splits: int, dtype: torch.dtype) -> None:
    """x as float32 K-split partial sums [splits, tokens, hidden] (`layers/linear.py`): the kernel and
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


def test_add_rms_norm_float32_scale_keeps_the_dtype() -> None:
    x, residual = (torch.randn(2, 64, device=DEVICE).bfloat16() for _ in range(2))
    scale = torch.tensor([0.5], device=DEVICE)  # float32: scaling by a power of two is exact either way
    normed = RMSNorm(64, with_scale=False).reference(x)
    expected = add_rms_norm_reference(x, residual, None, EPS, scale)
    assert torch.equal(expected, ((residual + normed) * scale).bfloat16())
    got = add_rms_norm(x, residual, None, EPS, scale, use_triton=True)
    assert got.dtype == torch.bfloat16
    assert_within_ulps(got, expected, (residual.float().abs() + normed.float().abs()) * 0.5, 1)


def test_add_norm_warps_by_row_count() -> None:
    """16 warps a row at decode sizes, 8 from prefill sizes (the H100 sweeps); never more than a row's columns
    need (one warp per 256)."""
    assert add_norm_warps(4096, 32) == 16
    assert add_norm_warps(4096, PREFILL_ROWS) == 8
    assert add_norm_warps(1024, 8192) == 4


def test_zero_tokens() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    assert add_rms_norm(empty, empty, None, EPS, torch.ones(1, device=DEVICE), use_triton=True).shape == (0, 64)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU default is the torch reference")
def test_cpu_default_is_the_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    rows, residual, scale = torch.randn(3, 32, generator=generator), torch.randn(3, 32, generator=generator), None
    scale = torch.tensor([0.3])
    assert torch.equal(
        add_rms_norm(rows, residual, None, EPS, scale), add_rms_norm_reference(rows, residual, None, EPS, scale)
    )
    assert torch.equal(rms_norm(rows, None, EPS), rms_norm_reference(rows, None, EPS))
