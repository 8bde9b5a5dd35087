"""Decode-sized projections: cuBLAS vs `skinny_linear`'s Triton kernel, with a sweep of its tiles, bf16, one GPU.

    PYTHONPATH=. python bench/bench_skinny_gemm.py [--models E4B E2B] [--rows 1 8 32] [--sweep] [--json out.json]

For every distinct projection shape of the chosen checkpoints (q, qkv, o of sliding and full layers, the
gate_up projection with gelu * up folded in, down) and each row count: a CUDA graph of enough copies of the
weight to overflow L2 (so weights come from HBM, as in a decode step) is timed by CUDA events
(`timing.time_cuda`); the table gives microseconds per projection and the bandwidth it reaches. cuBLAS is
F.linear (then `gelu_tanh_mul_packed` for gate_up); "default" is `skinny_linear` with `tuned_config`;
`--sweep` also times every tile config of the grid below and reports the best. Outputs must agree with cuBLAS
(max error relative to the largest output). Results go to --json, or to $OUT/bench_skinny_gemm.json.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from timing import time_cuda, write_json

from srt.configs.presets import preset_text_kwargs
from srt.layers.fused_kernels import gelu_tanh_mul_packed
from srt.layers.skinny_gemm import SkinnyConfig, skinny_linear, supports, tuned_config

L2_OVERFLOW_BYTES = 256 * 1024**2
SWEEP = [
    SkinnyConfig(block_n, block_k, warps, stages)
    for block_n, block_k, warps, stages in itertools.product((16, 32, 64), (128, 256), (4,), (3, 5))
]


def projection_shapes(text: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, gated) of one checkpoint's decoder projections (N: output columns, I for gate_up)."""
    hidden, heads, head_dim = text["hidden_size"], text["num_attention_heads"], text["head_dim"]
    kv_heads, full_dim = text["num_key_value_heads"], text.get("global_head_dim") or head_dim
    full_kv = text.get("num_global_key_value_heads") or kv_heads
    full_kv_projections = 1 if text.get("attention_k_eq_v") else 2
    inter = text["intermediate_size"]
    shapes = {
        "q": (heads * head_dim, hidden, False),
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden, False),
        "o": (hidden, heads * head_dim, False),
        "q_full": (heads * full_dim, hidden, False),
        "qkv_full": ((heads + full_kv_projections * full_kv) * full_dim, hidden, False),
        "o_full": (hidden, heads * full_dim, False),
        "gate_up": (inter, hidden, True),
        "down": (hidden, inter, False),
    }
    if text.get("use_double_wide_mlp"):
        shapes |= {"gate_up_wide": (2 * inter, hidden, True), "down_wide": (hidden, 2 * inter, False)}
    return shapes


class Case:
    """Copies of one projection's weight and a decode batch's input, bf16 on the GPU."""

    def __init__(self, n: int, k: int, gated: bool, rows: int) -> None:
        bf16, device = torch.bfloat16, torch.device("cuda")
        weight_rows = 2 * n if gated else n
        copies = max(4, -(-L2_OVERFLOW_BYTES // (2 * weight_rows * k)))
        self.weights = [torch.randn(weight_rows, k, device=device, dtype=bf16) / k**0.5 for _ in range(copies)]
        self.x = torch.randn(rows, k, device=device, dtype=bf16)
        self.gated = gated
        self.bytes = 2 * weight_rows * k

    def cublas(self, weight: torch.Tensor) -> torch.Tensor:
        out = F.linear(self.x, weight)
        return gelu_tanh_mul_packed(out) if self.gated else out

    def us(self, fn) -> float:
        step = lambda: [fn(w) for w in self.weights]  # noqa: E731
        return 1e6 * time_cuda(step, warmup=5, repeats=30, use_graph=True) / len(self.weights)


def run_case(name: str, n: int, k: int, gated: bool, rows: int, sweep: bool) -> dict:
    case = Case(n, k, gated, rows)
    expected = case.cublas(case.weights[0]).float()

    def error(config: SkinnyConfig) -> float:
        got = skinny_linear(case.x, case.weights[0], gated, config, use_triton=True).float()
        return float((got - expected).abs().max() / expected.abs().max())

    cublas_us = case.us(case.cublas)
    default = tuned_config(rows, n, k, gated)
    result = {"shape": name, "n": n, "k": k, "gated": gated, "rows": rows, "cublas_us": round(cublas_us, 2)}
    if default is not None and supports(case.x, case.weights[0], default):
        result["default"] = default._asdict()
        result["default_us"] = round(case.us(lambda w: skinny_linear(case.x, w, gated, default, use_triton=True)), 2)
        result["default_rel_err"] = error(default)
    if sweep:
        timings = []
        for config in SWEEP:
            if not supports(case.x, case.weights[0], config):
                continue
            try:
                us = case.us(lambda w, c=config: skinny_linear(case.x, w, gated, c, use_triton=True))
            except triton.runtime.errors.OutOfResources:  # tiles x stages over the shared memory
                continue
            timings.append((us, config))
        best_us, best = min(timings)
        result |= {"best": best._asdict(), "best_us": round(best_us, 2), "best_rel_err": error(best)}
    fastest = min(result.get("best_us", 1e9), result.get("default_us", 1e9))
    result["gb_per_s"] = round(case.bytes / min(fastest, cublas_us) / 1e3, 1)
    result["speedup"] = round(cublas_us / fastest, 2) if fastest < 1e9 else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["E4B"], help="E2B E4B 26B-A4B 31B")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--shapes", nargs="+", help="only these projection names (e.g. o down)")
    parser.add_argument("--sweep", action="store_true", help="time every tile config of the grid too")
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/bench_skinny_gemm.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_skinny_gemm.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: us per projection (weights from HBM), bf16")
    print(f"{'model':>8} {'shape':>12} {'N':>6} {'K':>6} {'rows':>4} {'cublas':>7} {'default':>7} {'best':>7} "
          f"{'GB/s':>6} {'x':>5}  best config")  # fmt: skip
    results = []
    for model in args.models:
        shapes = projection_shapes(preset_text_kwargs(f"gemma-4-{model}-it"))
        for (name, (n, k, gated)), rows in itertools.product(shapes.items(), args.rows):
            if args.shapes and name not in args.shapes:
                continue
            r = run_case(name, n, k, gated, rows, args.sweep) | {"model": model}
            results.append(r)
            best = r.get("best")
            print(
                f"{model:>8} {name:>12} {n:>6} {k:>6} {rows:>4} {r['cublas_us']:>7.2f} {r.get('default_us', 0):>7.2f} "
                f"{r.get('best_us', 0):>7.2f} {r['gb_per_s']:>6.0f} {r['speedup'] or 0:>5.2f}  "
                f"{tuple(best.values()) if best else ''} err {r.get('best_rel_err', r.get('default_rel_err', 0)):.1e}",
                flush=True,
            )
    payload = {"device": torch.cuda.get_device_name(), "results": results}
    write_json(args.json, "bench_skinny_gemm.json", payload, indent=2)


if __name__ == "__main__":
    main()
