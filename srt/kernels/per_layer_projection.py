"""The per-layer-input (PLE) block of a Gemma 4 E2B/E4B decoder layer in two Triton kernels for decode.

The block is `projection(gelu_tanh(gate(hidden)) * per_layer_input)`: a [hidden -> ple_dim] GEMV, the fused
gelu, and a [ple_dim -> hidden] GEMV (E4B: 2560 -> 256 -> 2560). At decode (1..32 rows) each GEMV reads only
~1.3 MB of weights, yet cuBLAS spreads such skinny shapes over few CTAs and takes several us where HBM needs
~0.5 us: they are latency bound, not bandwidth bound. Here the three kernels become two over many CTAs:

    gate:     grid (ple_dim / BLOCK_P, SPLIT_K[, row blocks])
              CTA (p, s) multiplies hidden[:, K-chunk s] by gate_weight[P-block p, K-chunk s]^T
              -> partials[s, rows, P-block p]  (float32)
              (tile kernel) the CTA that finishes a P-block's last K-chunk (a per-block ticket counter) sums
              its partials in split order and stores gelu(.) * per_layer_input -> gated[rows, P-block p]
    project:  grid (hidden / BLOCK_N[, row blocks])
              out[rows, N-block] = gated @ projection_weight[N-block]^T, gated read whole (256 columns);
              the one-row kernel instead sums the partials and applies the gelu in its prologue

The sums run in a fixed order, so results are deterministic; the ticket counters live in a buffer allocated
once (`triton_support.ticket_counters`) and each call leaves them at zero, so CUDA-graph replays reuse them.
Before the tickets, the project kernel's prologue read SPLIT_K float32 partials per CTA (80 KB at 32 rows) in a
rolled loop: 5.3 us of a 32-row block's 8.0 on the H100.

On Hopper both are chained (programmatic dependent launch, `triton_support.pdl_start`): the gate kernel
starts while the residual add before it runs and loads its first weight block before it waits for the hidden
rows, and the project kernel starts while the gate kernel runs, loads its weight tile, and waits
(griddepcontrol.wait) only before it reads the gate's output.

Two shapes of the same kernels: one row is a plain multiply-and-sum GEMV (`_vector_*`); more rows go in
blocks of 16 (padded) through tl.dot (`_tile_*`): the padding costs compute but no memory traffic.

Rounding. The kernels round to the activation dtype where the torch ops round, so they agree with
`per_layer_input_projection_reference` up to float32 noise (summation order, exp vs tanh) that can flip the
last bit of a rounded bf16 value now and then: the gate GEMV's float32 sum is rounded (the Linear's output),
then gelu (sigmoid form, computed in float32) is rounded, then its product with per_layer_input, exactly as
`gelu_tanh_mul`; the projection accumulates in float32 and rounds once on store, as cuBLAS does.

Measured on an H100, bf16, 42 blocks in a CUDA graph (bench/tune/tune_ple.py), E4B: 4.2 us per block at 1 row vs
11.2 for the torch ops, 6.8 vs 11.4 at 8 rows, 7.6 vs 11.4 at 32. Above MAX_ROWS (prefill) `use_triton=None`
runs cuBLAS GEMMs around the fused gelu * mul kernel: cuBLAS catches up by ~128 rows, and prefill is not
latency bound.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from srt.kernels.gelu_mul import gelu_tanh_mul, gelu_tanh_mul_reference, gelu_tanh_mul_rounded
from srt.kernels.triton_support import (
    dot_options,
    jit,
    last_dim_contiguous,
    pdl_launch,
    pdl_start,
    round_to,
    runs_triton,
    ticket_counters,
    tl,
    triton,
)

MAX_ROWS = 32  # decode batches; the kernels still win at 64 rows, and lose at 128 (see the docstring)


@jit
def _gated(gate, ple, DTYPE: tl.constexpr):
    """gelu_tanh(gate) * ple from the gate GEMV's float32 sum, rounded to DTYPE where torch rounds."""
    return gelu_tanh_mul_rounded(round_to(gate, DTYPE), ple.to(tl.float32), DTYPE)


@jit
def _weight_block(weight_rows, k, p_mask, hidden_size):
    """The gate weight's [P-block, k] block (zeros past hidden_size): constant, so it may be read before the
    chained wait, and the next block while the current one multiplies."""
    return tl.load(weight_rows + k[None, :], mask=p_mask[:, None] & (k < hidden_size)[None, :], other=0.0)


# ---------------------------------------------------------------------------------------------------------
# one row: multiply-and-sum GEMVs


@jit
def _vector_gate_kernel(
    hidden_ptr, weight_ptr, partials_ptr, hidden_size, ple_dim, stride_weight,
    K_PER_SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(1)
    p_ids = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p_ids < ple_dim
    weight_rows = weight_ptr + p_ids.to(tl.int64)[:, None] * stride_weight
    w = _weight_block(weight_rows, split * K_PER_SPLIT + tl.arange(0, BLOCK_K), p_mask, hidden_size)
    # chained behind the residual add, with the first weight block on its way; the project kernel may start
    # now and fetch its weights meanwhile
    pdl_start(USE_PDL)
    acc = tl.zeros((BLOCK_P, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(K_PER_SPLIT // BLOCK_K):
        k = split * K_PER_SPLIT + step * BLOCK_K + tl.arange(0, BLOCK_K)
        h = tl.load(hidden_ptr + k, mask=k < hidden_size, other=0.0)
        if step + 1 < K_PER_SPLIT // BLOCK_K:  # the next weight block in flight while this one multiplies
            w_next = _weight_block(weight_rows, k + BLOCK_K, p_mask, hidden_size)
        acc += w.to(tl.float32) * h.to(tl.float32)[None, :]
        if step + 1 < K_PER_SPLIT // BLOCK_K:
            w = w_next
    tl.store(partials_ptr + split * ple_dim + p_ids, tl.sum(acc, axis=1), mask=p_mask)


@jit
def _vector_project_kernel(
    partials_ptr, ple_ptr, weight_ptr, out_ptr, hidden_size, ple_dim, stride_weight,
    SPLIT_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    p_ids = tl.arange(0, BLOCK_P)
    n_ids = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_mask = p_ids < ple_dim
    n_mask = n_ids < hidden_size
    w_offsets = n_ids.to(tl.int64)[:, None] * stride_weight + p_ids[None, :]
    w = tl.load(weight_ptr + w_offsets, mask=n_mask[:, None] & p_mask[None, :], other=0.0)
    ple = tl.load(ple_ptr + p_ids, mask=p_mask, other=0.0)
    pdl_start(USE_PDL)  # launched early: only from here on are the partials written
    gate = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # a fixed order: deterministic; unrolled: the loads overlap
        gate += tl.load(partials_ptr + split * ple_dim + p_ids, mask=p_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(w.to(tl.float32) * _gated(gate, ple, dtype)[None, :], axis=1)
    tl.store(out_ptr + n_ids, round_to(out, dtype).to(dtype), mask=n_mask)


# ---------------------------------------------------------------------------------------------------------
# 2+ rows: tl.dot on blocks of BLOCK_T rows (padded)


@jit
def _tile_gate_kernel(
    hidden_ptr, weight_ptr, partials_ptr, ple_ptr, gated_ptr, tickets_ptr, rows, hidden_size, ple_dim,
    stride_hidden, stride_weight, stride_ple,
    K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(1)
    row_ids = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    p_ids = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    row_mask = row_ids < rows
    p_mask = p_ids < ple_dim
    hidden_rows = hidden_ptr + row_ids.to(tl.int64)[:, None] * stride_hidden
    weight_rows = weight_ptr + p_ids.to(tl.int64)[:, None] * stride_weight
    w = _weight_block(weight_rows, split * K_PER_SPLIT + tl.arange(0, BLOCK_K), p_mask, hidden_size)
    pdl_start(USE_PDL)  # the first weight block is on its way; the hidden rows come from the kernel ahead
    acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for step in tl.static_range(K_PER_SPLIT // BLOCK_K):
        k = split * K_PER_SPLIT + step * BLOCK_K + tl.arange(0, BLOCK_K)
        h = tl.load(hidden_rows + k[None, :], mask=row_mask[:, None] & (k < hidden_size)[None, :], other=0.0)
        if step + 1 < K_PER_SPLIT // BLOCK_K:  # the next weight block in flight while this one multiplies
            w_next = _weight_block(weight_rows, k + BLOCK_K, p_mask, hidden_size)
        if UPCAST:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        if step + 1 < K_PER_SPLIT // BLOCK_K:
            w = w_next
    tile = (row_ids.to(tl.int64)[:, None] * ple_dim + p_ids[None, :], row_mask[:, None] & p_mask[None, :])
    tl.store(partials_ptr + split * rows * ple_dim + tile[0], acc, mask=tile[1])
    # the K-chunk that finishes last sums the block's partials (in split order: deterministic) and applies
    # gelu * per_layer_input, so the project kernel reads one bf16 tile instead of SPLIT_K float32 ones
    tl.debug_barrier()  # every thread's partial is stored before the ticket is taken (release, gpu scope)
    ticket_ptr = tickets_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
        gate = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            gate += tl.load(partials_ptr + s * rows * ple_dim + tile[0], mask=tile[1], other=0.0, cache_modifier=".cg")
        ple_offsets = row_ids.to(tl.int64)[:, None] * stride_ple + p_ids[None, :]
        ple = tl.load(ple_ptr + ple_offsets, mask=tile[1], other=0.0)
        dtype = gated_ptr.dtype.element_ty
        tl.store(gated_ptr + tile[0], _gated(gate, ple, dtype).to(dtype), mask=tile[1])
        tl.atomic_xchg(ticket_ptr, 0)  # ready for the next call (CUDA-graph replays reuse the tickets)


@jit
def _tile_project_kernel(
    gated_ptr, weight_ptr, out_ptr, rows, hidden_size, ple_dim, stride_weight, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row_ids = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    p_ids = tl.arange(0, BLOCK_P)
    n_ids = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids64 = row_ids.to(tl.int64)
    rp_mask = (row_ids < rows)[:, None] & (p_ids < ple_dim)[None, :]
    w_offsets = n_ids.to(tl.int64)[:, None] * stride_weight + p_ids[None, :]
    w_mask = (n_ids < hidden_size)[:, None] & (p_ids < ple_dim)[None, :]
    w = tl.load(weight_ptr + w_offsets, mask=w_mask, other=0.0)  # before the wait: overlaps the gate kernel
    pdl_start(USE_PDL)
    gated = tl.load(gated_ptr + row_ids64[:, None] * ple_dim + p_ids[None, :], mask=rp_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if UPCAST:
        acc = tl.dot(gated.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
    else:
        acc = tl.dot(gated, tl.trans(w), input_precision=PRECISION)
    out = round_to(acc, dtype)  # not a plain cast: the interpreter truncates float32 -> bfloat16
    out_mask = (row_ids < rows)[:, None] & (n_ids < hidden_size)[None, :]
    tl.store(out_ptr + row_ids64[:, None] * stride_out + n_ids[None, :], out.to(dtype), mask=out_mask)


# ---------------------------------------------------------------------------------------------------------
# the wrapper


def per_layer_input_projection_reference(
    hidden: torch.Tensor, per_layer_input: torch.Tensor, gate_weight: torch.Tensor, projection_weight: torch.Tensor
) -> torch.Tensor:
    """The torch ops the decoder layer runs: Linear, `gelu_tanh_mul_reference`, Linear (slow path and oracle)."""
    gate = F.linear(hidden, gate_weight)
    return F.linear(gelu_tanh_mul_reference(gate, per_layer_input), projection_weight)


class ProjectionTiles(NamedTuple):
    gate_block_p: int
    gate_block_k: int
    splits: int  # K-chunks of the gate GEMV, at most: more CTAs, but more partials for every project CTA
    project_block_n: int


def choose_tiles(rows: int) -> ProjectionTiles:
    """Tuned on an H100 at E2B/E4B shapes, bf16: ~80 gate CTAs and 40..160 project CTAs (bench/tune/tune_ple.py;
    at 32 rows `--sweep` put 128-column project tiles first: 6.71 vs 6.90 us a block with 64)."""
    if rows == 1:
        return ProjectionTiles(gate_block_p=16, gate_block_k=256, splits=5, project_block_n=16)
    return ProjectionTiles(gate_block_p=32, gate_block_k=256, splits=5, project_block_n=64 if rows <= 16 else 128)


def per_layer_input_projection(
    hidden: torch.Tensor,
    per_layer_input: torch.Tensor,
    gate_weight: torch.Tensor,
    projection_weight: torch.Tensor,
    use_triton: bool | None = None,
    tiles: ProjectionTiles | None = None,
) -> torch.Tensor:
    """projection(gelu_tanh(gate(hidden)) * per_layer_input): [T, H] in hidden's dtype.

    hidden: [T, H]; per_layer_input: [T, P] (e.g. the slice `per_layer[:, i]` of a [T, layers, P] tensor);
    both any row stride with a contiguous last dim, in one dtype. gate_weight: [P, H] and projection_weight:
    [H, P], the two nn.Linear weights. `use_triton`: None runs the kernels on CUDA for T <= MAX_ROWS, cuBLAS
    around `gelu_tanh_mul` above, and the reference off CUDA; True forces them (on the CPU only under
    TRITON_INTERPRET=1). `tiles` overrides `choose_tiles` (bench/tune/tune_ple.py). Graph safe.
    """
    rows, hidden_size = hidden.shape
    ple_dim = gate_weight.shape[0]
    if per_layer_input.shape != (rows, ple_dim) or gate_weight.shape != (ple_dim, hidden_size):
        raise ValueError(
            f"per_layer_input_projection: hidden {list(hidden.shape)}, per_layer_input "
            f"{list(per_layer_input.shape)}, gate_weight {list(gate_weight.shape)}"
        )
    if projection_weight.shape != (hidden_size, ple_dim):
        raise ValueError(f"per_layer_input_projection: projection_weight {list(projection_weight.shape)}")
    dtypes = {hidden.dtype, per_layer_input.dtype, gate_weight.dtype, projection_weight.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"per_layer_input_projection: mixed dtypes {sorted(map(str, dtypes))}")
    if not runs_triton(hidden.device, use_triton, _tile_gate_kernel):
        return per_layer_input_projection_reference(hidden, per_layer_input, gate_weight, projection_weight)
    if use_triton is None and rows > MAX_ROWS:  # prefill: cuBLAS GEMMs around the fused gelu * mul kernel
        gated = gelu_tanh_mul(F.linear(hidden, gate_weight), per_layer_input)
        return F.linear(gated, projection_weight)
    hidden, per_layer_input = last_dim_contiguous(hidden), last_dim_contiguous(per_layer_input)
    gate_weight, projection_weight = last_dim_contiguous(gate_weight), last_dim_contiguous(projection_weight)
    out = torch.empty((rows, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if rows == 0:
        return out
    tiles = tiles or choose_tiles(rows)
    precision, upcast = dot_options(_tile_gate_kernel, hidden.dtype)
    launch_pdl = pdl_launch(hidden.device, _tile_gate_kernel)
    pdl = bool(launch_pdl)
    # K in whole gate_block_k steps, spread over at most tiles.splits chunks (the last one may be short)
    k_steps = triton.cdiv(hidden_size, tiles.gate_block_k)
    k_per_split = triton.cdiv(k_steps, min(tiles.splits, k_steps)) * tiles.gate_block_k
    splits = triton.cdiv(hidden_size, k_per_split)
    partials = torch.empty((splits, rows, ple_dim), dtype=torch.float32, device=hidden.device)
    p_blocks, n_blocks = triton.cdiv(ple_dim, tiles.gate_block_p), triton.cdiv(hidden_size, tiles.project_block_n)
    block_p = max(16, triton.next_power_of_2(ple_dim))  # the project kernel's prologue: all of ple_dim
    if rows == 1:
        _vector_gate_kernel[(p_blocks, splits)](
            hidden, gate_weight, partials, hidden_size, ple_dim, gate_weight.stride(0),
            K_PER_SPLIT=k_per_split, BLOCK_P=tiles.gate_block_p, BLOCK_K=tiles.gate_block_k, USE_PDL=pdl,
            num_warps=4, **launch_pdl,
        )  # fmt: skip
        _vector_project_kernel[(n_blocks,)](
            partials, per_layer_input, projection_weight, out, hidden_size, ple_dim, projection_weight.stride(0),
            SPLIT_K=splits, BLOCK_P=block_p, BLOCK_N=tiles.project_block_n, USE_PDL=pdl, num_warps=4, **launch_pdl,
        )  # fmt: skip
        return out
    # blocks of 16 rows (tl.dot's minimum): at 32 rows two blocks beat one of 32 (whose prologue spills)
    block_t = 16
    row_blocks = triton.cdiv(rows, block_t)
    gated = torch.empty((rows, ple_dim), dtype=hidden.dtype, device=hidden.device)
    _tile_gate_kernel[(p_blocks, splits, row_blocks)](
        hidden, gate_weight, partials, per_layer_input, gated,
        ticket_counters("ple_gate", hidden.device, p_blocks * row_blocks),
        rows, hidden_size, ple_dim, hidden.stride(0), gate_weight.stride(0), per_layer_input.stride(0),
        K_PER_SPLIT=k_per_split, SPLIT_K=splits, BLOCK_T=block_t, BLOCK_P=tiles.gate_block_p,
        BLOCK_K=tiles.gate_block_k, PRECISION=precision, UPCAST=upcast, USE_PDL=pdl, num_warps=4, **launch_pdl,
    )  # fmt: skip
    _tile_project_kernel[(n_blocks, row_blocks)](
        gated, projection_weight, out, rows, hidden_size, ple_dim, projection_weight.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=tiles.project_block_n,
        PRECISION=precision, UPCAST=upcast, USE_PDL=pdl, num_warps=4, **launch_pdl,
    )  # fmt: skip
    return out
