"""Decode projections in a chain, as a decode step runs them: cuBLAS vs the K-split partials paths. bf16, one GPU.

    PYTHONPATH=. python bench/bench_split_k.py [--models E4B] [--rows 1 32] [--sweep] [--json out.json]

For every projection shape of the chosen checkpoints (`bench_gemm_layouts.projection_shapes`, no LM head) and
each row count, a CUDA graph of LAYERS links, one per layer with its own weight (so weights come from HBM):

    norm (chained Triton add + norm, K wide) -> projection -> add + norm of its output (N wide)

is timed by CUDA events; the table gives microseconds per link. The projection is one of:

    cublas      F.linear on the transposed weight, bf16 output (the add + norm reads it)
    bmm_s2      `split_k.linear_partials` over cuBLAS: a batched GEMM over 2 K-chunks, float32 partials
    triton      `split_k.linear_partials`' Triton kernel with `split_k.tuned_tiles` (or the best of --sweep)

The chain matters: the Triton kernel starts while the norm ahead runs and streams its weight then, and the
add + norm after it starts early in turn, which a projection timed alone would not show. Every variant's
norm output is checked against cublas's (max error relative to the largest value).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_gemm_layouts import projection_shapes
from timing import time_cuda, write_json

from srt.configs.presets import preset_text_kwargs
from srt.layers.fused_kernels import add_rms_norm
from srt.layers.split_k import SplitKTiles, linear_partials, tuned_tiles

LAYERS = 42  # E4B's layer count
SWEEP = [
    SplitKTiles(*tiles)
    for tiles in itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4, 8))
    if tiles[0] * tiles[1] * 2 <= 64 * 1024
]


def chain(n: int, k: int, rows: int, project) -> tuple[callable, torch.Tensor]:
    """The LAYERS-link graph body for one projection and the last link's output."""
    weights = [(torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5).t() for _ in range(LAYERS)]
    source = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    residual_k = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    residual_n = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    norm_k = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    norm_n = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    outputs = []

    def body() -> None:
        outputs.clear()
        for weight in weights:
            x = add_rms_norm(source, residual_k, norm_k, 1e-6)
            outputs.append(add_rms_norm(project(x, weight), residual_n, norm_n, 1e-6))

    return body, outputs


def run_shape(n: int, k: int, rows: int, sweep: bool) -> dict:
    projections = {
        "cublas": lambda x, w: F.linear(x, w),
        "bmm_s2": lambda x, w: linear_partials(x, w, use_triton=False),
    }
    tiles_tried = SWEEP if sweep else [tuned_tiles(n, k) or SplitKTiles(64, 128, 1, 4)]
    for tiles in tiles_tried:
        if n % tiles.block_n == 0 and k % (tiles.block_k * tiles.steps) == 0 and 2 <= tiles.splits(k) <= 16:
            projections[f"triton{tuple(tiles)}"] = lambda x, w, tiles=tiles: linear_partials(x, w, tiles, True)
    result = {"n": n, "k": k, "rows": rows, "us": {}, "rel_err": {}}
    expected = None
    for name, project in projections.items():
        torch.manual_seed(0)
        body, outputs = chain(n, k, rows, project)
        us = 1e6 * time_cuda(body, warmup=5, repeats=30, use_graph=True) / LAYERS
        body()
        got = outputs[-1].float()
        expected = got if expected is None else expected
        result["us"][name] = round(us, 2)
        result["rel_err"][name] = float((got - expected).abs().max() / expected.abs().max())
        del body, outputs
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["E4B"], help="E2B E4B 26B-A4B 31B")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--shapes", nargs="+", help="only these projections (q qkv o q_full ... down)")
    parser.add_argument("--sweep", action="store_true", help="time every tile choice of SWEEP")
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/bench_split_k.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_k.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}: us per norm -> projection -> add + norm link, {LAYERS} layers, bf16")
    results = []
    for model in args.models:
        shapes = projection_shapes(preset_text_kwargs(f"gemma-4-{model}-it"))
        shapes.pop("lm_head")
        for shape, (n, k) in shapes.items():
            if args.shapes and shape not in args.shapes:
                continue
            for rows in args.rows:
                r = run_shape(n, k, rows, args.sweep) | {"model": model, "shape": shape}
                results.append(r)
                tritons = {name: us for name, us in r["us"].items() if name.startswith("triton")}
                best = min(tritons, key=tritons.get) if tritons else "-"
                print(
                    f"{model:>6} {shape:>8} N {n:>5} K {k:>5} rows {rows:>2}: cublas {r['us']['cublas']:6.2f}"
                    f" bmm_s2 {r['us']['bmm_s2']:6.2f} {best} {tritons.get(best, float('nan')):6.2f}"
                    f" (max err {max(r['rel_err'].values()):.1e})",
                    flush=True,
                )
    write_json(args.json, "bench_split_k.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
