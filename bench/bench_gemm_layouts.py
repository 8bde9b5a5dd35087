"""Which cuBLAS call streams a decode-sized projection fastest? bf16, one GPU, weights from HBM.

    PYTHONPATH=. python bench/bench_gemm_layouts.py [--models E4B] [--rows 1 32] [--json out.json]

For every projection shape of the chosen checkpoints (`projection_shapes`, plus the LM head)
and each row count, a CUDA graph over enough copies of the weight to overflow L2 times (CUDA events) each way
of asking cuBLAS for x @ W^T:

    linear      F.linear(x, W), W [N, K] contiguous, as nn.Linear stores it
    nn          x @ Wt with Wt = W^T stored [K, N] contiguous: what srt runs (gemma4_layers.store_transposed)
    lt_*        the same two with torch.backends.cuda.preferred_blas_library("cublaslt")
    bmm_s{S}    S K-chunks of nn as one batched GEMM with float32 output, [S, rows, N] partial sums for the
                add + norm after the projection to sum (srt's o and down at decode sizes: layers/split_k.py)

and prints microseconds per projection, the bandwidth of the best and its speedup over `linear`. Every
variant's output is checked against `linear`'s (max error relative to the largest output).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import time_cuda, write_json

from srt.configs.presets import preset_text_kwargs
from srt.layers.split_k import linear_partials

L2_OVERFLOW_BYTES = 256 * 1024**2


def projection_shapes(text: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one checkpoint's decoder projections, as cuBLAS runs them (gate_up stacked)."""
    hidden, heads, head_dim = text["hidden_size"], text["num_attention_heads"], text["head_dim"]
    kv_heads, full_dim = text["num_key_value_heads"], text.get("global_head_dim") or head_dim
    full_kv = text.get("num_global_key_value_heads") or kv_heads
    full_kv_projections = 1 if text.get("attention_k_eq_v") else 2
    inter = text["intermediate_size"]
    shapes = {
        "q": (heads * head_dim, hidden),
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "q_full": (heads * full_dim, hidden),
        "qkv_full": ((heads + full_kv_projections * full_kv) * full_dim, hidden),
        "o_full": (hidden, heads * full_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    if text.get("use_double_wide_mlp"):
        shapes |= {"gate_up_wide": (4 * inter, hidden), "down_wide": (hidden, 2 * inter)}
    return shapes | {"lm_head": (text["vocab_size"], hidden)}


def variants(weights: list[torch.Tensor]) -> dict[str, tuple[str, list[torch.Tensor], object]]:
    """name -> (BLAS library, operands, x -> callable(operand))."""
    transposed = [w.t().contiguous() for w in weights]
    linear = lambda x, w: F.linear(x, w)  # noqa: E731
    nn = lambda x, wt: x @ wt  # noqa: E731
    return {
        "linear": ("cublas", weights, linear),
        "nn": ("cublas", transposed, nn),
        "lt_linear": ("cublaslt", weights, linear),
        "lt_nn": ("cublaslt", transposed, nn),
        "bmm_s2": ("cublas", transposed, lambda x, wt: linear_partials(x, wt.t(), splits=2)),
        "bmm_s4": ("cublas", transposed, lambda x, wt: linear_partials(x, wt.t(), splits=4)),
    }


def run_shape(n: int, k: int, rows: int) -> dict:
    copies = max(4, -(-L2_OVERFLOW_BYTES // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x, weights[0]).float()
    result = {"n": n, "k": k, "rows": rows}
    for name, (library, operands, fn) in variants(weights).items():
        torch.backends.cuda.preferred_blas_library(library)
        try:
            got = fn(x, operands[0]).float()
            got = got.sum(0) if got.dim() == 3 else got  # partial sums
            step = lambda fn=fn, operands=operands: [fn(x, w) for w in operands]  # noqa: E731
            us = 1e6 * time_cuda(step, warmup=5, repeats=30, use_graph=True) / copies
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        result[name] = {"us": round(us, 2), "rel_err": float((got - expected).abs().max() / expected.abs().max())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["E4B"], help="E2B E4B 26B-A4B 31B")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/bench_gemm_layouts.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm_layouts.py needs a CUDA device")
    torch.manual_seed(0)
    names = list(variants([]))
    print(f"{torch.cuda.get_device_name()}: us per projection (weights from HBM), bf16")
    columns = " ".join(f"{name:>9}" for name in names)
    print(f"{'model':>6} {'shape':>10} {'N':>6} {'K':>6} {'rows':>4} {columns}   GB/s  best")
    results = []
    for model in args.models:
        text = preset_text_kwargs(f"gemma-4-{model}-it")
        for name, (n, k) in projection_shapes(text).items():
            for rows in args.rows:
                r = run_shape(n, k, rows) | {"model": model, "shape": name}
                results.append(r)
                best = min(names, key=lambda v: r[v]["us"])
                print(
                    f"{model:>6} {name:>10} {n:>6} {k:>6} {rows:>4} " + " ".join(f"{r[v]['us']:>9.2f}" for v in names)
                    + f" {2 * n * k / r[best]['us'] / 1e3:>6.0f}  {best} {r['linear']['us'] / r[best]['us']:.2f}x"
                    + f" (max err {max(r[v]['rel_err'] for v in names):.1e})",
                    flush=True,
                )  # fmt: skip
    write_json(args.json, "bench_gemm_layouts.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
