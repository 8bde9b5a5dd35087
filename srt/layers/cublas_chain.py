"""cuBLAS GEMMs chained to the kernel ahead of them inside a captured CUDA graph (programmatic dependent launch).

srt's Triton kernels are chained (`triton_support.pdl_start`): launched early, their CTAs wait inside the
kernel for the one ahead. cuBLAS launches its kernels itself, without that launch attribute, so in a captured
decode step every GEMM starts only after the kernel ahead has finished and the GEMM's own launch has gone
through: 0.45-0.93 us of idle GPU before each of a layer's four GEMMs at E4B batch 32 (docs/benchmarks.md).

While a stream captures, `chain_next_launch` turns the stream's capture dependency into the programmatic edge
that a chained launch records, so the next node may start as soon as the kernel ahead lets it
(griddepcontrol.launch_dependents, or its exit). That is correct only for a kernel that itself waits
(griddepcontrol.wait) before it reads what the kernel ahead writes, and cuBLAS does not document which of its
kernels do. So `chained_gemm` first runs each GEMM (kind, shapes, strides) chained behind a kernel that writes
the GEMM's input late, during the step's warm-up, and chains it in the capture only if the result was right.

SRT_CUBLAS_CHAIN=0 turns this off (A/B runs); it is off wherever Triton's PDL is (`triton_support`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

import torch

from srt.layers.graph_mode import in_cuda_graph_step
from srt.layers.triton_support import gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl, triton

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("SRT_CUBLAS_CHAIN", "0") != "0"

# the CUDA driver API's graph-edge constants (cuda.h, CUDA 12.3+)
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_DEPENDENCY_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_SET_CAPTURE_DEPENDENCIES = 1  # CU_STREAM_SET_CAPTURE_DEPENDENCIES


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class _Driver:
    """The three driver calls that read and rewrite a capturing stream's dependencies."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.get_capture_info = lib.cuStreamGetCaptureInfo_v3
        self.get_capture_info.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)),
            ctypes.POINTER(ctypes.POINTER(_EdgeData)),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        self.update_dependencies = lib.cuStreamUpdateCaptureDependencies_v2
        self.update_dependencies.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(_EdgeData),
            ctypes.c_size_t,
            ctypes.c_uint,
        ]
        self.node_type = lib.cuGraphNodeGetType
        self.node_type.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]


_driver: _Driver | None = None


def _get_driver() -> _Driver | None:
    global _driver
    if _driver is None:
        try:
            _driver = _Driver()
        except (OSError, AttributeError) as error:  # no driver, or one older than CUDA 12.3
            logger.info("cuBLAS chaining unavailable: %s", error)
            return None
    return _driver


def chain_next_launch(stream: torch.cuda.Stream | None = None) -> bool:
    """Make the next node captured on `stream` (default: the current stream) depend on the kernel captured
    last through a programmatic edge. False, and nothing changed, unless the stream captures and its one
    dependency is a kernel node."""
    driver = _get_driver()
    if driver is None:
        return False
    handle = ctypes.c_void_p((stream or torch.cuda.current_stream()).cuda_stream)
    status, capture_id, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    nodes, edges, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.POINTER(_EdgeData)(), ctypes.c_size_t()
    result = driver.get_capture_info(handle, status, capture_id, graph, nodes, edges, count)
    if result != 0 or status.value != 1 or count.value != 1:  # 1: CU_STREAM_CAPTURE_STATUS_ACTIVE
        return False
    node_type = ctypes.c_int()
    if driver.node_type(nodes[0], node_type) != 0 or node_type.value != _KERNEL_NODE:
        return False
    node = (ctypes.c_void_p * 1)(nodes[0])
    edge = (_EdgeData * 1)(_EdgeData(_PORT_PROGRAMMATIC, 0, _DEPENDENCY_PROGRAMMATIC))
    return driver.update_dependencies(handle, node, edge, 1, _SET_CAPTURE_DEPENDENCIES) == 0


@jit
def _late_copy_kernel(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """dst = src, written only after `spin` rounds of dependent arithmetic; lets the next kernel launch first."""
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


def gemm_waits(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, spin: int = 20000) -> bool:
    """Whether `gemm(x)`, captured chained behind a kernel that writes x late (~0.1 ms after it lets the GEMM
    launch), reads the new x: it does only if its kernels wait for the kernel ahead. Runs two CUDA graphs;
    call it outside any capture."""
    if not (x.is_cuda and x.is_contiguous()) or not pdl_launch(x.device, _late_copy_kernel):
        return False
    source = x.clone()
    expected = gemm(source)
    probe_input = torch.zeros_like(x)
    block = 1024
    grid = (triton.cdiv(x.numel(), block),)
    stream = torch.cuda.Stream(x.device)
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            _late_copy_kernel[grid](source, probe_input, x.numel(), 1, BLOCK=block, launch_pdl=True)  # compiles
            gemm(probe_input)  # cuBLAS's lazy workspace and handles, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                probe_input.zero_()
                _late_copy_kernel[grid](source, probe_input, x.numel(), spin, BLOCK=block, launch_pdl=True)
                chained = chain_next_launch()
                out = gemm(probe_input)
        if not chained:
            return False
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize(x.device)
            if not torch.equal(out, expected):
                difference = (out.float() - expected.float()).abs().max().item()
                logger.info(
                    "cuBLAS chaining probe: %s differs by up to %g (expected up to %g)",
                    list(x.shape),
                    difference,
                    expected.float().abs().max().item(),
                )
                return False
        return True
    except RuntimeError as error:  # e.g. a GEMM whose first node may not take a programmatic edge
        logger.info("cuBLAS chaining: probe failed (%s)", error)
        torch.cuda.synchronize(x.device)
        return False


_checked: dict[tuple, bool] = {}


def chained_gemm(kind: str, gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weight: torch.Tensor):
    """gemm(x), its first kernel chained to the kernel ahead when captured in a CUDA-graph step and checked
    (`gemm_waits`, once per kind and shapes, in the step's warm-up); a plain call otherwise."""
    if not (ENABLED and x.is_cuda and in_cuda_graph_step()):
        return gemm(x)
    key = (kind, tuple(x.shape), x.stride(), x.dtype, tuple(weight.shape), weight.stride(), x.device)
    if torch.cuda.is_current_stream_capturing():
        if _checked.get(key):
            chain_next_launch()
        return gemm(x)
    if key not in _checked:
        _checked[key] = gemm_waits(gemm, x)
        logger.info("cuBLAS chaining of %s %s: %s", kind, list(x.shape), "on" if _checked[key] else "off")
    return gemm(x)
