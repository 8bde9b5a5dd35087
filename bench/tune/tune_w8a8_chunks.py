"""Tiles and K-chunks of srt's W8A8 decode GEMM at shapes with few column blocks, as the decode step chains them.

    PYTHONPATH=. python bench/tune/tune_w8a8_chunks.py [--rows 32] [--json out.json]

Shapes: 26B-A4B's dense MLP (gate_up of 2 x 2112 over K 2816, gelu in the epilogue; down 2816 x 2112) and, for
comparison, E4B's gate_up (2 x 10240 over 2560). For each candidate (tiles x K-chunks; gated GEMMs in chunks sum
their partials in the column block's last chunk, `decode_gemm_fp8_variants`), LAYERS copies of the weight (more
bytes than the L2 holds) are multiplied one after the other, chained, in one CUDA graph: us per call, as in a
decode step, and the largest difference from the one-chunk kernel's output. srt's choice is marked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from srt.kernels.decode_gemm import GemmTiles
from srt.kernels.decode_gemm_fp8_variants import (
    decode_gelu_mlp_fp8_variant,
    decode_linear_fp8_variant,
    w8a8_gated_plan,
    w8a8_splits,
    w8a8_tiles,
)
from srt.layers.fp8_linear import Fp8Linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py
from timing import time_cuda, write_json  # noqa: E402

LAYERS = 12
# (name, n, k, gated): n is each half's width for gated GEMMs
SHAPES = [
    ("26B-A4B gate_up", 2112, 2816, True),
    ("26B-A4B down", 2816, 2112, False),
    ("E4B gate_up", 10240, 2560, True),
]
GATED_CANDIDATES = [(GemmTiles(64, 128, 3, 4), c) for c in (1, 2, 11)] + [
    (GemmTiles(64, 64, 6, 4), c) for c in (2, 4, 11)
]
DOWN_CANDIDATES = [
    (GemmTiles(256, 64, 6, 4), 3),
    (GemmTiles(128, 64, 4, 4), 3),
    (GemmTiles(64, 64, 6, 4), 3),
    (GemmTiles(128, 64, 4, 4), 11),
    (GemmTiles(64, 64, 6, 4), 11),
]


def layer(n: int, k: int, seed: int) -> Fp8Linear:
    """A random per-channel FP8 layer on the GPU (values do not matter for time; they are compared across plans)."""
    weight = torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) / k**0.5
    out = Fp8Linear(k, n, None, device="cuda")
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
    out.weight.copy_((weight / scale).to(torch.float8_e4m3fn))
    out.weight_scale.copy_(out.scale_from_checkpoint(scale))
    return out


def run(x: torch.Tensor, fp8: Fp8Linear, gated: bool, tiles: GemmTiles, chunks: int) -> torch.Tensor:
    """The GEMM's output: gelu * up, or [chunks, rows, n] float32 partials (which the step's norm kernel sums)."""
    args = (x, fp8.weight, fp8.weight_scale, fp8.block_k, "w8a8")
    if gated:
        return decode_gelu_mlp_fp8_variant(*args, tiles=tiles, splits=chunks)
    return decode_linear_fp8_variant(*args, splits=chunks, tiles=tiles)


def summed(out: torch.Tensor) -> torch.Tensor:
    return out.float() if out.dim() == 2 else out.sum(0)


def chained(x: torch.Tensor, layers: list[Fp8Linear], gated: bool, tiles: GemmTiles, chunks: int):
    return lambda: [run(x, fp8, gated, tiles, chunks) for fp8 in layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32])
    parser.add_argument("--json", type=Path, help="Results file (default $OUT/tune_w8a8_chunks.json).")
    args = parser.parse_args()
    results = []
    for name, n, k, gated in SHAPES:
        layers = [layer(2 * n if gated else n, k, seed) for seed in range(LAYERS)]
        if gated:
            srt = w8a8_gated_plan(n, k, k)
        else:
            splits = w8a8_splits(n, k, k)
            srt = (w8a8_tiles(splits, n, k, k), splits)
        candidates = list(dict.fromkeys([srt, *(GATED_CANDIDATES if gated else DOWN_CANDIDATES)]))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            expected = summed(run(x, layers[0], gated, *candidates[0]))
            for tiles, chunks in candidates:
                if k % (chunks * tiles.block_k) or n % tiles.block_n:
                    continue
                diff = float((summed(run(x, layers[0], gated, tiles, chunks)) - expected).abs().max())
                us = 1e6 * time_cuda(chained(x, layers, gated, tiles, chunks), warmup=3, repeats=30, use_graph=True)
                us /= LAYERS
                mark = " (srt)" if (tiles, chunks) == srt else ""
                print(f"{name} rows {rows}: {tiles} x {chunks} chunks: {us:6.2f} us, diff {diff:.1e}{mark}", flush=True)
                results.append({"shape": name, "n": n, "k": k, "gated": gated, "rows": rows, "tiles": list(tiles),
                                "chunks": chunks, "us": us, "max_abs_diff": diff, "srt": bool(mark)})  # fmt: skip
        del layers
        torch.cuda.empty_cache()
    write_json(args.json, "tune_w8a8_chunks.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
