"""Does an add + norm kernel that asks L2 for the next GEMM's weight make the pair faster? bf16, one GPU.

    PYTHONPATH=. python bench/bench_l2_prefetch.py [--rows 1 32] [--json out.json]

Each case is a CUDA graph of pairs (`add_rms_norm_then_norm` at E4B's hidden size, then a cuBLAS GEMM
x @ W_i^T) over enough distinct weights W_i to overflow L2, as in a decode step. The norm kernel either
prefetches nothing, or the leading `row_bytes` of every row of the W_i that follows it (all of it for the
small projections). Printed: microseconds per pair, and the gain over no prefetch. The norm is chained
(programmatic dependent launch) as in the model; the GEMM is cuBLAS, which is not.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import time_cuda

from srt.layers.fused_kernels import add_rms_norm_then_norm
from srt.layers.triton_support import L2Prefetch

HIDDEN = 2560
L2_OVERFLOW_BYTES = 512 * 1024**2
# E4B projections: name -> (N, K) and the row prefixes (bytes) to try; None = whole rows
SHAPES = {
    "q": (2048, 2560, [None]),
    "qkv": (3072, 2560, [None]),
    "o": (2560, 2048, [None]),
    "qkv_full": (6144, 2560, [None, 2048]),
    "gate_up": (20480, 2560, [256, 512, 1024]),
    "down": (2560, 10240, [1024, 2048, 4096]),
}


def time_pairs(rows: int, n: int, k: int, row_bytes: int | None, prefetch: bool) -> float:
    copies = max(4, -(-L2_OVERFLOW_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(hidden)
    norm_weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def pairs() -> None:
        for weight in weights:
            hint = L2Prefetch(weight, row_bytes) if prefetch else None
            add_rms_norm_then_norm(hidden, residual, norm_weight, 1e-6, norm_weight, 1e-6, prefetch=hint)
            F.linear(x, weight)

    return time_cuda(pairs, warmup=5, repeats=30, use_graph=True) / copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for rows in args.rows:
        for name, (n, k, prefixes) in SHAPES.items():
            base = time_pairs(rows, n, k, None, prefetch=False)
            line = f"rows {rows:3d} {name:9s} none {base * 1e6:7.2f} us"
            for row_bytes in prefixes:
                us = time_pairs(rows, n, k, row_bytes, prefetch=True)
                line += f" | {row_bytes or 'all'}: {us * 1e6:7.2f} us ({(base - us) * 1e6:+.2f})"
                results.append({"rows": rows, "shape": name, "n": n, "k": k, "row_bytes": row_bytes,
                                "none_us": base * 1e6, "prefetch_us": us * 1e6})  # fmt: skip
            print(line, flush=True)
    out = args.json or (Path(os.environ["OUT"]) / "bench_l2_prefetch.json" if "OUT" in os.environ else None)
    if out:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
