"""Can a Triton GEMM stream decode-sized projection weights as fast as cuBLAS? (E4B shapes, bf16, weights from HBM)

cuBLAS's kernels cannot be chained to the kernel ahead (bench/probe_cublas_chain.py: they do not wait for it),
so every GEMM of a decode step idles behind its producer. A Triton GEMM could be chained, and load its weights
before it waits; this times the candidate on its own first: weight tiles by TMA (host-side tensor descriptors)
or plain loads, software-pipelined over K, optionally split over K into float32 partials (as srt's o and down
projections already are, `split_k.linear_partials`), against cuBLAS on srt's transposed weight layout.

    PYTHONPATH=. python3 bench/bench_tma_gemm.py [--rows 1 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from timing import time_cuda, write_json
from triton.tools.tensor_descriptor import TensorDescriptor

from srt.layers.split_k import linear_partials

L2_OVERFLOW_BYTES = 256 * 1024**2
SHAPES = {"qkv": (3072, 2560), "o": (2560, 2048), "gate_up": (20480, 2560), "down": (2560, 10240)}  # (N, K)


@triton.jit
def _gemm_kernel(
    x_desc, w_desc, x_ptr, w_ptr, out_ptr, M, N, K, K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """out[split] = x[:, K-chunk] @ w[K-chunk, N-block], float32; w is [K, N] contiguous (srt's layout)."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_start + K_PER_SPLIT, BLOCK_K, num_stages=STAGES):
        if TMA:
            a = x_desc.load([0, k])
            b = w_desc.load([k, n0])
        else:
            a = tl.load(x_ptr + offs_m[:, None] * K + (k + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
            b = tl.load(w_ptr + (k + offs_k)[:, None] * N + offs_n[None, :])
        acc = tl.dot(a, b, acc)
    out = out_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=offs_m[:, None] < M)


def triton_gemm(x: torch.Tensor, w_kn: torch.Tensor, config: tuple) -> torch.Tensor:
    block_n, block_k, stages, splits, tma, warps = config
    m, k = x.shape
    n = w_kn.shape[1]
    block_m = max(16, triton.next_power_of_2(m))
    out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w_kn, [block_k, block_n])
    _gemm_kernel[(n // block_n, splits)](
        x_desc, w_desc, x, w_kn, out, m, n, k, k // splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, TMA=tma, num_warps=warps,
    )  # fmt: skip
    return out


def configs(n: int, k: int) -> list[tuple]:
    found = []
    for block_n, block_k, stages, splits, tma, warps in itertools.product(
        (64, 128, 256), (64, 128), (4,), (1, 2, 4, 8), (True, False), (4,)
    ):
        ctas = (n // block_n) * splits
        smem = stages * block_k * block_n * 2
        if n % block_n or k % (splits * block_k) or not 32 <= ctas <= 528 or smem > 200 * 1024:
            continue
        found.append((block_n, block_k, stages, splits, tma, warps))
    return found


def run_shape(name: str, n: int, k: int, rows: int) -> dict:
    copies = max(4, -(-L2_OVERFLOW_BYTES // (2 * n * k)))
    weights_kn = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ weights_kn[0].float()
    baseline = partial(linear_partials, splits=2) if name in ("o", "down") else F.linear
    cublas = lambda w: baseline(x, w.t())  # noqa: E731  (srt's cuBLAS call on srt's layout)
    us = {"cublas": 1e6 * time_cuda(lambda: [cublas(w) for w in weights_kn], 5, 30, use_graph=True) / copies}
    errors = {}
    for config in configs(n, k):
        try:
            got = triton_gemm(x, weights_kn[0], config).sum(0)
            errors[config] = float((got - expected).abs().max() / expected.abs().max())
            step = lambda config=config: [triton_gemm(x, w, config) for w in weights_kn]  # noqa: E731
            us[config] = 1e6 * time_cuda(step, 5, 30, use_graph=True) / copies
        except Exception as error:  # noqa: BLE001  (a config the compiler or TMA rejects)
            print(f"  {name} {config}: {type(error).__name__}: {str(error)[:120]}")
    ranked = sorted((v, c) for c, v in us.items() if c != "cublas")
    floor = 2 * n * k / 2.98e12 * 1e6
    print(f"{name:8s} rows {rows:3d}: cuBLAS {us['cublas']:.2f} us, floor {floor:.2f}; best Triton:")
    for value, config in ranked[:5]:
        print(
            f"    {value:7.2f} us  (block_n, block_k, stages, splits, tma, warps) = {config}  err {errors[config]:.1e}"
        )
    return {
        "shape": name, "n": n, "k": k, "rows": rows, "cublas_us": us["cublas"], "floor_us": floor,
        "best": [{"config": list(c), "us": v, "rel_err": errors[c]} for v, c in ranked[:10]],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/bench_tma_gemm.json)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    results = [run_shape(name, *SHAPES[name], rows) for name in args.shapes for rows in args.rows]
    write_json(args.json, "bench_tma_gemm.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
