"""Grouped expert GEMMs over token slots sorted by expert and padded to whole row blocks.

A slot is one (token, k) pair: slot = token * top_k + k. `ExpertBlocks` (built in `fused_experts.py`) lists
the slots expert by expert, each expert's run padded with the sentinel `num_slots` to a multiple of BLOCK_M,
so that every block of BLOCK_M rows belongs to one expert:

    rows:          | e0 e0 e0 -- | e3 e3 e3 e3 | e3 -- -- -- | e7 -- -- -- | (unused blocks) ...
    block_expert:  |      0      |      3      |      3      |      7      |
                   <------------ num_rows (device scalar) --------------->

Kernel 1, grid (row blocks, cdiv(inter, BLOCK_N)): rows x gate_up_proj[e] -> gate and up tiles of the same
columns -> gelu_tanh(gate) * up, stored to `act[slot]` [num_slots, inter].
Kernel 2, grid (row blocks, cdiv(hidden, BLOCK_N)): act[slot] x down_proj[e] times the slot's routing weight,
stored to `out[slot]` [num_slots, hidden]; the caller sums the top_k slots of each token.
Blocks past num_rows return at once: the grid is sized from shapes alone, so nothing is read back to the host.

FP8 weights (W_FP8; `Experts.quantize_fp8`): each float8_e4m3fn tile is widened before the dot, and the float32
accumulator's columns are multiplied by their output channel's scale in the epilogue: before gelu(gate) * up in
kernel 1, before the routing weight in kernel 2. x @ (q * s).T == (x @ q.T) * s, so this is the dequantized GEMM
with half the weight bytes streamed. Both operands go to float16 (`triton_support.fp8_dot_dtype`: one cvt per two
weights, where bfloat16 takes three), 16-bit rows saturated at float16's largest value: exact for every e4m3
weight and for bf16 rows of magnitude 2^-17 to 65504; float32 rows stay float32.

W8A8 (`ExpertsConfig.w8a8`: prefill sizes on GPUs with FP8 tensor cores): the rows come in quantized too, as
float8_e4m3fn with a float32 scale per row (`fp8_quant.quantize_fp8`: per token for kernel 1, per slot of
gelu(gate) * up for kernel 2), the FP8 tiles multiply as they are on the FP8 tensor cores (twice the bf16 rate,
no upcast), and the epilogue scales by the row's scale beside the column's. The numerics of the dense FP8 prefill
GEMMs (per-token activation scales), not of the dequantized reference. At decode sizes the weight bytes bound
the kernels, so they stay weight-only: W8A8 measured no faster there (docs/benchmarks.md, FP8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.kernels.gelu_mul import gelu_tanh_f32
from srt.kernels.triton_support import (
    as_dot_operand,
    dot_options,
    fp8_dot_dtype,
    has_fp8_tensor_cores,
    jit,
    kernel_runs_on,
    tl,
    triton,
)


@dataclass(frozen=True)
class ExpertsConfig:
    block_m: int
    block_n_gate_up: int  # columns of gate (and as many of up) per program
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int
    # (w @ x.T).T instead of x @ w.T: the weight tile becomes the dot's first operand, which Hopper's wgmma may
    # read from registers, where an upcast FP8 tile is; and its row count (BLOCK_N), not a decode batch's few
    # rows, fills the MMA's M. An option for the sweeps (bench_moe.py --fp8), off by default.
    swap_ab: bool = False
    # FP8 weights only: the rows come quantized (per token, then per slot), FP8 MMAs (module docstring)
    w8a8: bool = False


# W8A8 blocks above decode sizes (H100, bench_moe.py --fp8, 2026-11-26; sums promoted every K-step): 512 tokens
# 438 us against 561 weight-only and 715 bf16; 7000 tokens 1,721 against 2,550 and 2,053
W8A8_CONFIG = ExpertsConfig(64, 64, 128, 128, 4, 4, w8a8=True)


def default_experts_config(
    num_slots: int, num_experts: int, on_gpu: bool, fp8: bool = False, w8a8: bool = False
) -> ExpertsConfig:
    """Block shapes by the mean number of slots per expert (decode: ~0 to 2, prefill: hundreds). `w8a8`: the
    FP8 weights' rows may be quantized too (`w8a8_possible`), which prefill sizes then do."""
    if not on_gpu:
        return ExpertsConfig(16, 16, 16, 16, 4, 1)
    per_expert = num_slots / num_experts
    if per_expert > 4 and w8a8:  # decode sizes stream weights: W8A8 measured within 3% of weight-only there
        return W8A8_CONFIG
    if per_expert <= 4 and fp8:  # twice the K per tile: as many weight bytes in flight as the bf16 tiles
        return ExpertsConfig(16, 32, 64, 256, 4, 4)
    if per_expert <= 4:  # weight streaming: many narrow programs keep enough loads in flight
        return ExpertsConfig(16, 32, 64, 128, 4, 4)
    if per_expert <= 64:
        return ExpertsConfig(32, 64, 64, 64, 4, 4)
    # down tiles 256 wide: 1.10x over 128 at 7000 tokens on the H100 (bench/tune/tune_moe_experts.py)
    return ExpertsConfig(128, 64, 256, 64, 8, 3)


@jit
def _gate_up_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    scale_ptr,
    act_ptr,
    slot_of_row_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_slots,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_act,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    W_FP8: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    slots = tl.load(slot_of_row_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] tiles of gate rows (0..inter) and up rows (inter..2*inter), transposed by indexing
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + INTER * stride_wn
    if SWAP_AB:
        gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = offs_k < HIDDEN - k0
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_ptrs + k0, mask=w_ok, other=0.0)
        w_up = tl.load(up_ptrs + k0, mask=w_ok, other=0.0)
        if W_FP8 and not A_FP8:  # weight-only: both operands in float16 (module docstring)
            x = as_dot_operand(x, fp8_dot_dtype(x.dtype))
        if W_FP8:  # weight-only: widen to x's dtype; W8A8: x is FP8 already and nothing converts
            w_gate, w_up = w_gate.to(x.dtype), w_up.to(x.dtype)
        if UPCAST:
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        if SWAP_AB:
            gate = _dot(tl.trans(w_gate), tl.trans(x), gate, PRECISION, BLOCK_K)
            up = _dot(tl.trans(w_up), tl.trans(x), up, PRECISION, BLOCK_K)
        else:
            gate = _dot(x, w_gate, gate, PRECISION, BLOCK_K)
            up = _dot(x, w_up, up, PRECISION, BLOCK_K)
    if SWAP_AB:
        gate, up = tl.trans(gate), tl.trans(up)
    if W_FP8:  # per output channel: gate's columns, then up's (inter further on)
        scale_ptrs = scale_ptr + expert * stride_se + offs_n
        gate *= tl.load(scale_ptrs, mask=col_ok, other=0.0)[None, :]
        up *= tl.load(scale_ptrs + INTER, mask=col_ok, other=0.0)[None, :]
    if A_FP8:  # per token
        x_scale = tl.load(x_scale_ptr + tokens, mask=row_ok, other=0.0)[:, None]
        gate, up = gate * x_scale, up * x_scale
    act = gelu_tanh_f32(gate) * up
    act_ptrs = act_ptr + slots[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@jit
def _down_kernel(
    act_ptr,
    act_scale_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    weights_ptr,
    slot_of_row_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_slots,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_out,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    W_FP8: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    slots = tl.load(slot_of_row_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots
    slots64 = slots.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    act_ptrs = act_ptr + slots64[:, None] * stride_act + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = offs_k < INTER - k0
        a = tl.load(act_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if W_FP8 and not A_FP8:
            a = as_dot_operand(a, fp8_dot_dtype(a.dtype))
        if W_FP8:
            w = w.to(a.dtype)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if SWAP_AB:
            acc = _dot(tl.trans(w), tl.trans(a), acc, PRECISION, BLOCK_K)
        else:
            acc = _dot(a, w, acc, PRECISION, BLOCK_K)
    if SWAP_AB:
        acc = tl.trans(acc)
    if W_FP8:
        acc *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=col_ok, other=0.0)[None, :]
    if A_FP8:  # per slot
        acc *= tl.load(act_scale_ptr + slots64, mask=row_ok, other=0.0)[:, None]
    acc = acc * tl.load(weights_ptr + slots64, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + slots64[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w8a8_possible(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether W8A8 blocks can multiply `hidden`'s rows by `weight`: FP8 weights, 16-bit activations (float32
    ones keep their precision: weight-only), a device with FP8 tensor cores."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    return fp8 and hidden.dtype in (torch.bfloat16, torch.float16) and has_fp8_tensor_cores(hidden.device)


@jit
def _dot(a, b, acc, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a @ b. FP8 operands (W8A8): sm90's FP8 MMA sums its products in reduced precision (about 14 bits),
    and Triton lets it run over the whole K loop there; this adds its sum into the float32 accumulator every K
    step instead (as DeepGEMM and cuBLAS do; without it 26B-A4B shapes at 2048 tokens were 1.3% off, H100)."""
    if a.dtype.is_fp8():
        return tl.dot(a, b, acc, input_precision=PRECISION, max_num_imprecise_acc=BLOCK_K)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: CUDA, or the CPU under Triton's interpreter."""
    return kernel_runs_on(device, _gate_up_kernel)


def _dot_options(x: torch.Tensor) -> dict[str, object]:
    precision, upcast = dot_options(_gate_up_kernel, x.dtype)
    return {"PRECISION": precision, "UPCAST": upcast}


def _fp8_options(
    weight: torch.Tensor, scale: torch.Tensor | None, scale_shape: tuple[int, ...], rows: torch.Tensor
) -> dict[str, object]:
    """The kernels' FP8 arguments: the scale tensor (its stride per expert) with W_FP8, or none of it; A_FP8
    where the rows are float8_e4m3fn too (W8A8, FP8 weights only)."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (scale is not None):
        raise ValueError(f"float8_e4m3fn weights come with a scale and 16-bit ones without (got {weight.dtype})")
    a_fp8 = rows.dtype == torch.float8_e4m3fn
    if a_fp8 and not fp8:
        raise ValueError(f"float8_e4m3fn rows multiply float8_e4m3fn weights only, got {weight.dtype}")
    if not fp8:
        return {"scale_ptr": None, "stride_se": 0, "W_FP8": False, "A_FP8": False}
    if tuple(scale.shape) != scale_shape or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(f"FP8 scale must be float32 {list(scale_shape)} with unit column stride; got {scale.shape}")
    return {"scale_ptr": scale, "stride_se": scale.stride(0), "W_FP8": True, "A_FP8": a_fp8}


def _row_scale(rows: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor | None:
    """The float32 scale per row that float8_e4m3fn rows come with (`quantize_fp8`'s [rows, 1]); 16-bit rows none."""
    if (rows.dtype == torch.float8_e4m3fn) != (row_scale is not None):
        raise ValueError(f"float8_e4m3fn rows come with a scale per row and 16-bit ones without (got {rows.dtype})")
    if row_scale is None:
        return None
    if row_scale.shape not in ((rows.shape[0],), (rows.shape[0], 1)) or row_scale.dtype != torch.float32:
        raise ValueError(f"row scale must be float32 [{rows.shape[0]}] or [{rows.shape[0]}, 1]; got {row_scale.shape}")
    return row_scale.contiguous()


def grouped_gate_up(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    slot_of_row: torch.Tensor,
    block_expert: torch.Tensor,
    num_rows: torch.Tensor,
    top_k: int,
    config: ExpertsConfig,
    scale: torch.Tensor | None = None,
    hidden_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """act [tokens * top_k, inter] = gelu_tanh(x @ gate.T) * (x @ up.T) of each slot's token and expert, in
    `out_dtype` (default: hidden's). FP8 `gate_up_proj` comes with its float32 `scale` [experts, 2 * inter]
    (w = q * scale[..., None]); FP8 `hidden` (W8A8) with its float32 `hidden_scale` per token."""
    tokens, hidden_size = hidden.shape
    inter = gate_up_proj.shape[1] // 2
    num_slots = tokens * top_k
    act = torch.empty(num_slots, inter, dtype=out_dtype or hidden.dtype, device=hidden.device)
    grid = (block_expert.numel(), triton.cdiv(inter, config.block_n_gate_up))
    _gate_up_kernel[grid](
        x_ptr=hidden,
        x_scale_ptr=_row_scale(hidden, hidden_scale),
        w_ptr=gate_up_proj,
        act_ptr=act,
        slot_of_row_ptr=slot_of_row,
        block_expert_ptr=block_expert,
        num_rows_ptr=num_rows,
        num_slots=num_slots,
        stride_x=hidden.stride(0),
        stride_we=gate_up_proj.stride(0),
        stride_wn=gate_up_proj.stride(1),
        stride_act=act.stride(0),
        **_fp8_options(gate_up_proj, scale, (gate_up_proj.shape[0], 2 * inter), hidden),
        TOP_K=top_k,
        HIDDEN=hidden_size,
        INTER=inter,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n_gate_up,
        BLOCK_K=config.block_k,
        SWAP_AB=config.swap_ab,
        **_dot_options(hidden),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return act


def grouped_down(
    act: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    slot_of_row: torch.Tensor,
    block_expert: torch.Tensor,
    num_rows: torch.Tensor,
    config: ExpertsConfig,
    scale: torch.Tensor | None = None,
    act_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out [tokens * top_k, hidden] = (act @ down.T) * routing weight, per slot (weights: float32 [slots]), in
    `out_dtype` (default: act's). FP8 `down_proj` comes with its float32 `scale` [experts, hidden]; FP8 `act`
    (W8A8) with its float32 `act_scale` per slot."""
    num_slots, inter = act.shape
    hidden_size = down_proj.shape[1]
    out = torch.empty(num_slots, hidden_size, dtype=out_dtype or act.dtype, device=act.device)
    grid = (block_expert.numel(), triton.cdiv(hidden_size, config.block_n_down))
    _down_kernel[grid](
        act_ptr=act,
        act_scale_ptr=_row_scale(act, act_scale),
        w_ptr=down_proj,
        out_ptr=out,
        weights_ptr=weights,
        slot_of_row_ptr=slot_of_row,
        block_expert_ptr=block_expert,
        num_rows_ptr=num_rows,
        num_slots=num_slots,
        stride_act=act.stride(0),
        stride_we=down_proj.stride(0),
        stride_wn=down_proj.stride(1),
        stride_out=out.stride(0),
        **_fp8_options(down_proj, scale, tuple(down_proj.shape[:2]), act),
        HIDDEN=hidden_size,
        INTER=inter,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n_down,
        BLOCK_K=config.block_k,
        SWAP_AB=config.swap_ab,
        **_dot_options(act),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
