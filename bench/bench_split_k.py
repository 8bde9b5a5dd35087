"""Could a decode-sized projection with a long K leave its split-K reduction to the kernel after it? bf16, GPU.

    PYTHONPATH=. python bench/bench_split_k.py [--rows 1 32] [--json out.json]

cuBLAS runs E4B's down projection (K = 10240) at 32 rows as a split-K GEMM plus a reduction kernel. If the
GEMM wrote its K-split partial sums in float32 instead, the residual add + norm that reads the output could
sum them itself: one launch less per layer. For E4B's projections, per row count, a CUDA graph
over enough weight copies to overflow L2 times (CUDA events):

    nn          x @ W^T on the row-major W^T srt stores (bf16 out: cuBLAS's own split-K and reduction)
    nn_f32      the same with float32 output (torch.mm out_dtype)
    bmm_s{S}    S K-chunks as one batched GEMM with float32 output: [S, rows, N] partial sums

Printed: microseconds per projection and each partial-sum variant's error against nn (relative to the
largest output).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from timing import time_cuda, write_json

L2_OVERFLOW_BYTES = 256 * 1024**2
SHAPES = {  # E4B (N, K)
    "down": (2560, 10240),
    "o_full": (2560, 4096),
    "o": (2560, 2048),
    "gate_up": (20480, 2560),
    "qkv_full": (6144, 2560),
    "qkv": (3072, 2560),
    "q": (2048, 2560),
}
SPLITS = (2, 4, 5, 8)


def variants(k: int) -> dict[str, object]:
    out = {
        "nn": lambda x, wt: x @ wt,
        "nn_f32": lambda x, wt: torch.mm(x, wt, out_dtype=torch.float32),
    }
    for s in SPLITS:
        if k % s == 0:
            out[f"bmm_s{s}"] = lambda x, wt, s=s: torch.bmm(
                x.view(x.shape[0], s, k // s).transpose(0, 1), wt.view(s, k // s, -1), out_dtype=torch.float32
            )
    return out


def run_shape(n: int, k: int, rows: int) -> dict:
    copies = max(4, -(-L2_OVERFLOW_BYTES // (2 * n * k)))
    weights_t = [(torch.randn(k, n, device="cuda") / k**0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = (x @ weights_t[0]).float()
    result = {"n": n, "k": k, "rows": rows}
    for name, fn in variants(k).items():
        got = fn(x, weights_t[0]).float()
        got = got.sum(0) if got.dim() == 3 else got
        step = lambda fn=fn: [fn(x, wt) for wt in weights_t]  # noqa: E731
        us = 1e6 * time_cuda(step, warmup=5, repeats=30, use_graph=True) / copies
        result[name] = {"us": round(us, 2), "rel_err": float((got - expected).abs().max() / expected.abs().max())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/bench_split_k.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_k.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: us per projection (weights from HBM), bf16 inputs")
    results = []
    for name, (n, k) in SHAPES.items():
        for rows in args.rows:
            r = run_shape(n, k, rows) | {"shape": name}
            results.append(r)
            cells = "  ".join(f"{v} {r[v]['us']:.2f} ({r[v]['rel_err']:.0e})" for v in variants(k))
            print(f"{name:>7} N {n} K {k} rows {rows:>3}: {cells}", flush=True)
    write_json(args.json, "bench_split_k.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
