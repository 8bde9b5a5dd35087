"""Can cuBLAS's decode GEMMs be chained to the kernel ahead of them (programmatic dependent launch)?

srt's Triton kernels are chained (`triton_support.pdl_start`): launched early, they wait inside the kernel
for the one ahead. cuBLAS launches its kernels without that attribute, so in a captured decode step each GEMM
starts only after the kernel ahead has finished (0.45-0.93 us idle before each of a layer's four GEMMs at E4B
batch 32). A captured graph can still chain a GEMM: rewriting the capturing stream's dependency into the
programmatic edge that a chained launch records (`chain_next_launch`) lets the next node start as soon as the
kernel ahead allows. That is correct only if the GEMM's kernel waits (griddepcontrol.wait) before it reads.

This probe captures each E4B decode projection chained behind a kernel that lets it launch at once but
writes its input ~0.1 ms later, and checks the GEMM's output against an unchained run. Two controls keep the
probe honest: a torch elementwise kernel (never waits: must print False) and a Triton kernel that waits
(must print True).

    PYTHONPATH=. python3 bench/probe_cublas_chain.py [--blas cublaslt]

H100, torch 2.11.0+cu130, 2026-11-23: every GEMM printed False (its output came from the zeroed input), so
srt leaves cuBLAS unchained (docs/benchmarks.md, eighth session).
"""

from __future__ import annotations

import argparse
import ctypes
import json
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# the CUDA driver API's graph-edge constants (cuda.h, CUDA 12.3+)
KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
DEPENDENCY_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
SET_CAPTURE_DEPENDENCIES = 1  # CU_STREAM_SET_CAPTURE_DEPENDENCIES
CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


def driver_calls() -> tuple[Callable, Callable, Callable]:
    """cuStreamGetCaptureInfo_v3, cuStreamUpdateCaptureDependencies_v2, cuGraphNodeGetType."""
    lib = ctypes.CDLL("libcuda.so.1")
    get_info, update, node_type = (
        lib.cuStreamGetCaptureInfo_v3,
        lib.cuStreamUpdateCaptureDependencies_v2,
        lib.cuGraphNodeGetType,
    )
    get_info.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)),
        ctypes.POINTER(ctypes.POINTER(EdgeData)),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    update.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(EdgeData),
        ctypes.c_size_t,
        ctypes.c_uint,
    ]
    node_type.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return get_info, update, node_type


def chain_next_launch() -> bool:
    """Make the next node captured on the current stream depend on the last captured kernel through a
    programmatic edge. False, and nothing changed, unless the stream captures with one kernel node ahead."""
    get_info, update, node_type = driver_calls()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    status, capture_id, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    nodes, edges, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.POINTER(EdgeData)(), ctypes.c_size_t()
    if get_info(stream, status, capture_id, graph, nodes, edges, count) != 0:
        return False
    if status.value != CAPTURE_ACTIVE or count.value != 1:
        return False
    kind = ctypes.c_int()
    if node_type(nodes[0], kind) != 0 or kind.value != KERNEL_NODE:
        return False
    node = (ctypes.c_void_p * 1)(nodes[0])
    edge = (EdgeData * 1)(EdgeData(PORT_PROGRAMMATIC, 0, DEPENDENCY_PROGRAMMATIC))
    return update(stream, node, edge, 1, SET_CAPTURE_DEPENDENCIES) == 0


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """dst = src, stored only after `spin` rounds of dependent arithmetic; lets the next kernel launch first."""
    gdc_wait()
    gdc_launch_dependents()
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src_ptr + offsets, mask=mask)
    busy = tl.program_id(0).to(tl.float32)
    for _ in range(spin):
        busy = busy * 0.999 + 1.0
    # busy is never negative, which the compiler cannot know: the store waits for the loop
    tl.store(dst_ptr + offsets, tl.where(busy < 0, 0, values), mask=mask)


@triton.jit
def _waiting_double_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = 2 * src after waiting for the kernel ahead: the control that must pass."""
    gdc_wait()
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask) * 2, mask=mask)


def waiting_double(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _waiting_double_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def gemm_waits(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, spin: int = 20000) -> str:
    """'waits' if `gemm(x)`, captured chained behind a kernel that writes x late, read the new x; otherwise
    what went wrong."""
    source = x.clone()
    expected = gemm(source)
    probe_input = torch.zeros_like(x)
    grid = (triton.cdiv(x.numel(), 1024),)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _late_copy_kernel[grid](source, probe_input, x.numel(), 1, BLOCK=1024, launch_pdl=True)  # compiles
        gemm(probe_input)  # cuBLAS's lazy handles and workspace, outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            probe_input.zero_()
            _late_copy_kernel[grid](source, probe_input, x.numel(), spin, BLOCK=1024, launch_pdl=True)
            chained = chain_next_launch()
            out = gemm(probe_input)
    if not chained:
        return "not chained (no single kernel node ahead)"
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, expected):
            difference = (out.float() - expected.float()).abs().max().item()
            return f"read stale input (max diff {difference:.3g}, max |expected| {expected.abs().max().item():.3g})"
    return "waits"


def cublas_partials(x: torch.Tensor, weight: torch.Tensor, splits: int = 2) -> torch.Tensor:
    """srt's cuBLAS form of o and down before the Triton decode GEMM: a batched GEMM over K-chunks, float32."""
    chunks = x.view(x.shape[0], splits, -1).transpose(0, 1)
    return torch.bmm(chunks, weight.t().reshape(splits, -1, weight.shape[0]), out_dtype=torch.float32)


def transposed_weight(out_features: int, in_features: int) -> torch.Tensor:
    """An nn.Linear weight [out, in] stored as srt stores it: a view of a contiguous [in, out]."""
    return torch.randn(in_features, out_features, device="cuda", dtype=torch.bfloat16).t() * 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="Decode batch sizes to probe.")
    parser.add_argument("--blas", choices=["cublas", "cublaslt"], default="cublas", help="torch's BLAS library.")
    parser.add_argument("--json", help="Write the results here.")
    args = parser.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    torch.manual_seed(0)
    hidden, heads_dim, kv_dim, intermediate = 2560, 2048, 512, 10240
    shapes = {"qkv": (heads_dim + 2 * kv_dim, hidden), "q": (heads_dim, hidden), "o": (hidden, heads_dim)}
    shapes |= {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
    weights = {name: transposed_weight(*shape) for name, shape in shapes.items()}
    gemms = {name: partial(F.linear, weight=weights[name]) for name in ("qkv", "q", "gate_up")}
    gemms |= {name: partial(cublas_partials, weight=weights[name]) for name in ("o", "down")}
    gemms["control: torch elementwise (must not wait)"] = lambda x: x * 2
    gemms["control: Triton kernel that waits (must wait)"] = waiting_double
    results = []
    for rows in args.rows:
        for name, gemm in gemms.items():
            in_features = weights[name].shape[1] if name in weights else hidden
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            outcome = gemm_waits(gemm, x)
            print(f"rows {rows:3d}  {name:46s} {outcome}", flush=True)
            results.append({"rows": rows, "gemm": name, "outcome": outcome})
    device = torch.cuda.get_device_name()
    print(device, "torch", torch.__version__, "BLAS", args.blas)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device, "torch": torch.__version__, "blas": args.blas, "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
