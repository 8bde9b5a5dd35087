"""The Triton plumbing shared by srt's kernels (`srt/kernels/`).

- `triton`, `tl`, `jit`: the modules and `triton.jit`, or None / an identity decorator on CPU-only installs
  (no triton): the kernels stay plain functions there and the torch references serve every call.
- `runs_triton`: each wrapper's `use_triton` switch (None: Triton on CUDA, the reference elsewhere);
  `kernel_runs_on`: whether a kernel can run on a device at all.
- `is_interpreted`: whether a kernel runs under Triton's CPU interpreter (TRITON_INTERPRET=1 set before the
  kernel's module was imported, as test/conftest.py does); `dot_options`: a tl.dot's precision there and on GPU.
- `round_to`: float32 -> a dtype's nearest value, the same on the GPU and in the interpreter;
  `round_to_e4m3`: the same for float8_e4m3fn (FP8 KV caches).
- `has_pdl`, `gdc_wait`, `gdc_launch_dependents`: programmatic dependent launch (Hopper, newer Triton);
  `pdl_launch` and `pdl_start`: the launch option and the in-kernel prologue of a chained kernel.
- `ticket_counters`, `pending_tickets`: zeroed int32 counters for split-K kernels whose last program of a block
  (the one that draws the last ticket) finishes the block; every call leaves them at zero again.
"""

from __future__ import annotations

import functools

import torch

from srt import envs

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


def dot_options(kernel: object, dtype: torch.dtype) -> tuple[str, bool]:
    """(PRECISION, UPCAST) of `kernel`'s tl.dot over `dtype` operands. Triton's interpreter multiplies 16-bit
    floats in tl.dot as raw integers, so there the operands go up to float32 first (UPCAST; products of 16-bit
    floats are exact in float32: the same math). float32 operands never drop to TF32 on the tensor cores: the
    torch ops the kernels replace run in full float32."""
    interpreted = is_interpreted(kernel)
    return ("ieee" if interpreted or dtype == torch.float32 else "tf32"), interpreted


def kernel_runs_on(device: torch.device, kernel: object) -> bool:
    """Whether `kernel` can run on tensors of `device`: CUDA, or the CPU when it runs in Triton's interpreter."""
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and is_interpreted(kernel)))


def runs_triton(device: torch.device, use_triton: bool | None, kernel: object) -> bool:
    """Resolve `use_triton` (None: Triton on CUDA, the reference elsewhere) and check that Triton can run."""
    if use_triton is None:
        return device.type == "cuda" and triton is not None
    if use_triton:
        if not kernel_runs_on(device, kernel):
            raise RuntimeError(
                f"use_triton=True cannot run on {device.type}: needs CUDA, or the CPU with TRITON_INTERPRET=1 "
                "set before the kernel's module was imported"
            )
    return use_triton


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dim is contiguous (the kernels take any row strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


_TICKETS: dict[tuple[str, torch.device, int], torch.Tensor] = {}


def ticket_counters(kernel: str, device: torch.device, count: int) -> torch.Tensor:
    """`count` zeroed int32 counters for `kernel`'s blocks on `device`. One buffer per (kernel, device, count),
    allocated once and never freed or replaced (a CUDA graph that captured it keeps pointing at live memory);
    the calls that share it run one after the other (a chained kernel draws tickets only after its wait)."""
    tickets = _TICKETS.get((kernel, device, count))
    if tickets is None:
        tickets = _TICKETS[kernel, device, count] = torch.zeros(count, dtype=torch.int32, device=device)
    return tickets


def pending_tickets(kernel: str | None = None) -> int:
    """Counters of `kernel` (None: every kernel) left non-zero by the calls so far: 0 unless a call failed."""
    return sum(int(t.count_nonzero()) for (name, _, _), t in _TICKETS.items() if kernel in (None, name))


@functools.cache
def has_fp8_tensor_cores(device: torch.device) -> bool:
    """FP8 (e4m3) MMAs: CUDA devices of compute capability 8.9 (Ada) and up (Hopper, ...)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# Chained kernels (SRT_PDL=0 turns the chaining off, for A/B runs): a kernel launched with `pdl_launch`'s
# option may start while the kernel ahead of it still runs; its CTAs get resident and wait in `pdl_start`
# until that kernel has finished and its writes are visible, so the launch latency hides behind the previous
# kernel. `pdl_start` must come before the kernel's first store, and before its first load of anything a
# kernel of the step writes (the wait also orders its writes after the previous kernel's reads); constant
# weights and the step's metadata, filled before the graph runs, may be read before it.
PDL_ENABLED = envs.SRT_PDL.enabled()


def pdl_launch(device: torch.device, kernel: object) -> dict[str, bool]:
    """The launch keyword of a chained kernel: {"launch_pdl": True} where PDL runs, else {}; the kernel's
    USE_PDL constexpr is `bool(pdl_launch(...))`."""
    chained = PDL_ENABLED and gdc_wait is not None and not is_interpreted(kernel) and has_pdl(device)
    return {"launch_pdl": True} if chained else {}


@jit
def pdl_start(USE_PDL: tl.constexpr):
    """A chained kernel's wait for the kernel ahead, then the next one's launch: before the kernel's first
    store and its first load of anything the step's kernels write (see PDL_ENABLED's comment)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


# A chained kernel's programs get resident while the kernel ahead still runs (its wait returned, `pdl_start`) and
# idle until it ends; those that stream constant weights can prefetch the first of them into L2 meanwhile, so
# that their first K-steps hit L2 where they would have waited on HBM. SRT_L2_PREFETCH=0 turns it off (A/B).
L2_PREFETCH_ENABLED = envs.SRT_L2_PREFETCH.enabled()
# the bytes of each weight row a program prefetches, in the one-row GEMV and the float16 products alike; H100, E4B
# FP8 weights + KV, batch 1 / 32 ms a step (2026-11-28, l2-prefetch-*.json): none 2.95 / 4.16-4.17, 128 2.94 /
# 4.13, 256 2.91 / 4.08-4.10, 512 2.92 / 4.10, 1024 3.05 / 4.18, 4096 3.62 / 4.70 (the more the programs prefetch,
# the more the lines they need next wait behind the prefetched ones)
L2_PREFETCH_ROW_BYTES = 256


def l2_prefetch_bytes(device: torch.device, kernel: object, row_bytes: int, cap: int = L2_PREFETCH_ROW_BYTES) -> int:
    """The bytes of each weight row a chained `kernel` prefetches (`prefetch_l2`): up to `cap` of its
    `row_bytes`, a multiple of 16; 0 where it does not run (no PDL, the interpreter, SRT_L2_PREFETCH=0)."""
    if not (L2_PREFETCH_ENABLED and pdl_launch(device, kernel)):
        return 0
    return min(row_bytes, cap) // 16 * 16


@jit
def prefetch_l2(ptrs, NBYTES: tl.constexpr):
    """Prefetch NBYTES (a multiple of 16) from each 16-byte-aligned address of `ptrs` into L2: sm90's bulk
    prefetch, a hint that returns at once and brings nothing into registers."""
    if NBYTES > 0:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [ptrs, tl.full(ptrs.shape, NBYTES, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def _fp8_dot_dtype(x_dtype):
    """The dtype FP8 operands (K/V blocks, weight tiles) widen to for the dot products with an `x_dtype` operand:
    float16 for a 16-bit one, float32 for float32. sm90 widens e4m3 pairs to float16 in one instruction, and to
    bfloat16 only through float16 and then one scalar F2F per element (the decode attention kernel: 256 a thread
    per 64-token block; H100, FP8 weights + KV, batch 32: E4B 4.50 -> 4.45 ms/step). Every e4m3 value is exact in
    float16, and so is a bf16 value within float16's normal range (`as_dot_operand` saturates beyond it)."""
    return tl.float32 if x_dtype == tl.float32 else tl.float16


fp8_dot_dtype = triton.constexpr_function(_fp8_dot_dtype) if triton is not None else _fp8_dot_dtype


@jit
def as_dot_operand(x, DOT_DTYPE: tl.constexpr):
    """x as a dot product's DOT_DTYPE operand: float16 saturates at its largest finite value instead of
    overflowing to inf (normed queries and activations are orders of magnitude below it)."""
    if DOT_DTYPE == tl.float16:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0)
    return x.to(DOT_DTYPE)


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


# float32 additions of this constant round to multiples of 2^-9, e4m3's subnormal spacing: its float32 ulp
# (constexpr: compiled kernels may read no other globals; the interpreter does not check)
_E4M3_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14) if tl is not None else 1.5 * 2.0**14
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6) if tl is not None else 2.0**-6


@jit
def round_to_e4m3(x):
    """float32 `x` (|x| <= 448, NaN-free) rounded to the nearest float8_e4m3fn value (ties to even), as float32:
    then cast to float8e4nv exactly. Integer ops, as in `round_to`: the CPU interpreter's float32 -> fp8 cast
    neither rounds to nearest even nor carries a rounded-up mantissa into the exponent."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    # fixed spacing 2^-9 below 2^-6; rounded on |x|, the sign put back (-0 stays -0)
    subnormal = (tl.abs(x) + _E4M3_SUBNORMAL_ROUNDER) - _E4M3_SUBNORMAL_ROUNDER
    subnormal = (subnormal.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < _E4M3_MIN_NORMAL, subnormal, normal)
