"""The Triton plumbing shared by srt's fused kernels (fused_kernels, ple_kernels, qkv_norm_rope_store, ...).

- `triton`, `tl`, `jit`: the modules and `triton.jit`, or None / an identity decorator on CPU-only installs
  (no triton): the kernels stay plain functions there and the torch references serve every call.
- `runs_triton`: each wrapper's `use_triton` switch (None: Triton on CUDA, the reference elsewhere).
- `is_interpreted`: whether a kernel runs under Triton's CPU interpreter (TRITON_INTERPRET=1 set before the
  kernel's module was imported, as test/conftest.py does).
- `round_to`: float32 -> a dtype's nearest value, the same on the GPU and in the interpreter.
- `has_pdl`, `gdc_wait`, `gdc_launch_dependents`: programmatic dependent launch (Hopper, newer Triton);
  `pdl_launch` and `pdl_start`: the launch option and the in-kernel prologue of a chained kernel.
- `L2Prefetch`, `l2_prefetch_args`, `prefetch_l2`: a latency-bound kernel asks L2 for the next GEMM's weights.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # CPU-only installs: the references serve every call, the kernels stay plain functions
    triton = None
    tl = None
    jit = lambda fn: fn  # noqa: E731

try:  # programmatic dependent launch (newer Triton); without it the kernels launch one after the other
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` is Triton's InterpretedFunction: TRITON_INTERPRET=1 was set before its module was
    imported, so it runs on CPU tensors (and only there)."""
    return type(kernel).__name__ == "InterpretedFunction"


def runs_triton(device: torch.device, use_triton: bool | None, kernel: object) -> bool:
    """Resolve `use_triton` (None: Triton on CUDA, the reference elsewhere) and check that Triton can run."""
    if use_triton is None:
        return device.type == "cuda" and triton is not None
    if use_triton:
        if triton is None or not (device.type == "cuda" or (device.type == "cpu" and is_interpreted(kernel))):
            raise RuntimeError(
                f"use_triton=True cannot run on {device.type}: needs CUDA, or the CPU with TRITON_INTERPRET=1 "
                "set before the kernel's module was imported"
            )
    return use_triton


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dim is contiguous (the kernels take any row strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.cache
def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# Chained kernels (SRT_PDL=0 turns the chaining off, for A/B runs): a kernel launched with `pdl_launch`'s
# option may start while the kernel ahead of it still runs; its CTAs get resident and wait in `pdl_start`
# until that kernel has finished and its writes are visible, so the launch latency hides behind the previous
# kernel. `pdl_start` must come before the kernel's first load or store (the wait also orders its writes
# after the previous kernel's reads).
PDL_ENABLED = os.environ.get("SRT_PDL", "1") != "0"


def pdl_launch(device: torch.device, kernel: object) -> dict[str, bool]:
    """The launch keyword of a chained kernel: {"launch_pdl": True} where PDL runs, else {}; the kernel's
    USE_PDL constexpr is `bool(pdl_launch(...))`."""
    chained = PDL_ENABLED and gdc_wait is not None and not is_interpreted(kernel) and has_pdl(device)
    return {"launch_pdl": True} if chained else {}


@jit
def pdl_start(USE_PDL: tl.constexpr):
    """A chained kernel's first statement: wait for the kernel ahead, then let the next one launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 `x` rounded to DTYPE (round to nearest even), returned as float32.

    bfloat16 rounds in integer ops: Triton's CPU interpreter truncates float32 -> bfloat16 casts where the GPU
    rounds, and this keeps the tested path and the GPU path the same code (a few integer ops on registers).
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    else:
        return x.to(DTYPE).to(tl.float32)


# L2 prefetch (SRT_L2_PREFETCH=0 turns it off, for A/B runs). At decode the small kernels between two GEMMs
# (a residual add + norm, the attention's combine, the gelu) are latency bound and leave HBM idle. Before its
# own work such a kernel asks L2 for the bytes the GEMM after it reads first, so that GEMM starts with part of
# its weight on chip: all of a small weight (q, o, qkv), or the leading K-columns of every row of a large one
# (a one-wave GEMM streams every row from k = 0 at once). A prefetch is a hint: no register, no wait, no fault.
L2_PREFETCH_ENABLED = os.environ.get("SRT_L2_PREFETCH", "1") != "0"
L2_LINE_BYTES = 128  # prefetch_l2 spells it out: a jit function reads no plain module globals


class L2Prefetch(NamedTuple):
    """The leading `row_bytes` of every row of `weight` (a 2-D tensor with a contiguous last dim); None: all."""

    weight: torch.Tensor
    row_bytes: int | None = None


def l2_prefetch_args(prefetch: L2Prefetch | None, kernel: object) -> tuple[torch.Tensor | None, int, int, int, bool]:
    """(pointer, rows, row stride in bytes, lines per row, PREFETCH constexpr) for `prefetch_l2`; a prefetch
    runs only on CUDA builds of the kernel (the interpreter has no inline PTX) and when not switched off."""
    if prefetch is None or not L2_PREFETCH_ENABLED or is_interpreted(kernel) or prefetch.weight.device.type != "cuda":
        return None, 0, 0, 0, False
    weight = prefetch.weight
    row_bytes = weight.shape[-1] * weight.element_size()
    if prefetch.row_bytes is not None:
        row_bytes = min(row_bytes, prefetch.row_bytes)
    lines = -(-row_bytes // L2_LINE_BYTES)
    return weight, weight.shape[0], weight.stride(0) * weight.element_size(), lines, lines > 0


@jit
def prefetch_l2(ptr, rows, row_stride, lines_per_row, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """Ask L2 for `lines_per_row` 128-byte lines from the start of each of `rows` rows at `ptr` (`row_stride`
    bytes apart), this program's share of them: call it before `pdl_start`, with the grid's programs
    splitting the lines and BLOCK (e.g. 32 * num_warps) lines per instruction."""
    if PREFETCH:
        base = ptr.to(tl.pointer_type(tl.int8))
        program = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        total = rows * lines_per_row
        share = tl.cdiv(total, programs)
        first = program * share
        last = tl.minimum(first + share, total)
        for start in range(first, last, BLOCK):
            line = start + tl.arange(0, BLOCK)
            row = (line // lines_per_row).to(tl.int64)
            address = base + row * row_stride + (line % lines_per_row) * 128
            address = tl.where(line < last, address, base)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [address], dtype=tl.int32, is_pure=False, pack=1
            )
