"""Warm the L2 cache with the weight a coming GEMM reads, from a side stream, while latency-bound kernels run.

A decode step alternates bandwidth-bound cuBLAS GEMMs with chained Triton kernels (add + norm, attention's
combine, the per-layer-input block) that leave HBM idle for microseconds at a time. A prefetch issued on a
side stream at such a point (one CTA of `cp.async.bulk.prefetch.L2`, one instruction per 64 KB, no data
moved through the SM) lets the next GEMM read (part of) its weight from L2. The prefetch changes no value:
it only moves bytes into the cache.

`SRT_L2_PREFETCH` names the prefetches (comma separated, empty = none), each issued at a point of the
decoder layer (`Gemma4DecoderLayer`):

    qkv      after the MLP's down GEMM: the next layer's q/k/v weight (the per-layer-input block runs between)
    o        after the q/k/v GEMM: this layer's o weight (the q/k/v step and attention run between)
    gate_up  after the o GEMM: the first SRT_L2_PREFETCH_MB of the gate_up weight (the add + norm runs between)
    down     after the gate_up GEMM: the first SRT_L2_PREFETCH_MB of the down weight (the gelu runs between)

Only inside captured CUDA-graph steps (`graph_mode.in_cuda_graph_step`) on Hopper; elsewhere a no-op.
`join()` makes the capturing stream wait for the side stream (a graph's streams must rejoin before its end).
"""

from __future__ import annotations

import os

import torch

from srt.layers.graph_mode import in_cuda_graph_step
from srt.layers.triton_support import has_pdl, tl, triton

TARGETS = frozenset(name for name in os.environ.get("SRT_L2_PREFETCH", "").split(",") if name)
HEAD_BYTES = int(float(os.environ.get("SRT_L2_PREFETCH_MB", "16")) * 2**20)
CHUNK_BYTES = 65536
CHUNKS_PER_PROGRAM = 256


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offset = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offset, CHUNK)
    valid = size > 0
    size = tl.where(valid, size, 16).to(tl.int32)  # past the end: 16 bytes at the start again (harmless)
    address = base_ptr.to(tl.pointer_type(tl.uint8)) + tl.where(valid, offset, 0)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [address, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_to_l2(weight: torch.Tensor, max_bytes: int | None = None) -> None:
    """Start moving the first `max_bytes` (all by default) of `weight`'s storage into L2; returns at once.
    `weight` must be one contiguous block of memory (a transposed view of a contiguous tensor is)."""
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        raise ValueError("prefetch_to_l2 needs a weight stored as one contiguous block")
    nbytes = weight.numel() * weight.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes -= nbytes % 16  # the bulk prefetch moves multiples of 16 bytes
    if nbytes == 0:
        return
    chunks = triton.cdiv(nbytes, CHUNK_BYTES)
    grid = (triton.cdiv(chunks, CHUNKS_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](weight, nbytes, CHUNK=CHUNK_BYTES, BLOCK=CHUNKS_PER_PROGRAM, num_warps=8)


class SideStream:
    """The side stream prefetches run on, per device, made at the first prefetch."""

    streams: dict[torch.device, torch.cuda.Stream] = {}

    @classmethod
    def get(cls, device: torch.device) -> torch.cuda.Stream:
        if device not in cls.streams:
            cls.streams[device] = torch.cuda.Stream(device)
        return cls.streams[device]


def issue(target: str, weight: torch.Tensor | None) -> None:
    """Prefetch `weight` (whole, or its head for gate_up and down) on the side stream if `target` is enabled."""
    if weight is None or target not in TARGETS or not weight.is_cuda or not has_pdl(weight.device):
        return
    if not in_cuda_graph_step():
        return
    side = SideStream.get(weight.device)
    side.wait_stream(torch.cuda.current_stream(weight.device))
    with torch.cuda.stream(side):
        prefetch_to_l2(weight, HEAD_BYTES if target in ("gate_up", "down") else None)


def join(device: torch.device) -> None:
    """The current stream waits for every prefetch issued so far (before a captured step ends)."""
    if TARGETS and device.type == "cuda" and device in SideStream.streams and in_cuda_graph_step():
        torch.cuda.current_stream(device).wait_stream(SideStream.streams[device])
