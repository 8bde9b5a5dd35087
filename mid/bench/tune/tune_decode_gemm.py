"""Tiles of srt's chained decode GEMM (`srt/kernels/decode_gemm.py`) at E4B's decode projections, on Hopper.

Each candidate (block_n, block_k, stages, warps) runs as srt calls it: `decode_linear` with 4 float32 K-chunks
for the projections a norm kernel reads next (q, qkv, o, down), `decode_gelu_mlp` for gate_up with gelu * up in
its epilogue. A CUDA graph chains the calls over enough weight copies to overflow L2, so each call streams its
weight from HBM behind the one ahead, as in a decode step. Prints us per call, fastest first, next to srt's
current tiles and the floor (weight bytes over 2.98 TB/s); checks every candidate against F.linear.

    PYTHONPATH=. python3 bench/tune/tune_decode_gemm.py [--rows 32] [--shapes gated qkv ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from srt.kernels.decode_gemm import GATED, GemmTiles, decode_gelu_mlp, decode_linear, tiles_for
from srt.kernels.gelu_mul import gelu_tanh_mul_packed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py and friends
from timing import time_cuda, write_json  # noqa: E402

L2_OVERFLOW_BYTES = 256 * 1024**2
HBM_BYTES_PER_S = 2.98e12
# (N, K, splits) of E4B; gate_up's N is both halves
SHAPES = {
    "gated": (20480, 2560, GATED),
    "qkv": (3072, 2560, 4),
    "q_sliding": (2048, 2560, 4),
    "o_sliding": (2560, 2048, 4),
    "o_full": (2560, 4096, 4),
    "down": (2560, 10240, 4),
}
SMEM_BYTES = 200 * 1024


def candidates(n: int, k: int, splits: int | str, rows: int) -> list[GemmTiles]:
    halves = 2 if splits == GATED else 1
    chunk = k if splits == GATED else k // splits
    out_n = n // halves
    found = []
    for block_n, block_k, stages, warps in itertools.product((64, 128, 256), (64, 128), (3, 4, 5), (4, 8)):
        block_m = max(16, triton.next_power_of_2(rows))
        smem = stages * (block_m * block_k + halves * block_k * block_n) * 2
        if out_n % block_n or chunk % block_k or chunk // block_k < stages - 1 or smem > SMEM_BYTES:
            continue
        if warps == 8 and block_n < 128:
            continue
        found.append(GemmTiles(block_n, block_k, stages, warps))
    return found


def run_shape(name: str, rows: int) -> dict:
    n, k, splits = SHAPES[name]
    copies = max(4, -(-L2_OVERFLOW_BYTES // (2 * n * k)))
    weights = [(torch.randn(k, n, device="cuda") / k**0.5).bfloat16().t() for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda").bfloat16()
    product = F.linear(x, weights[0])
    expected = (gelu_tanh_mul_packed(product) if splits == GATED else product).float()

    def call(weight: torch.Tensor, tiles: GemmTiles | None) -> torch.Tensor:
        if splits == GATED:
            return decode_gelu_mlp(x, weight, tiles)
        return decode_linear(x, weight, splits, tiles).sum(0)

    current = tiles_for(splits, n // 2 if splits == GATED else n)
    rows_out = []
    for tiles in candidates(n, k, splits, rows):
        try:
            error = float((call(weights[0], tiles).float() - expected).abs().max() / expected.abs().max())
            us = 1e6 * time_cuda(lambda tiles=tiles: [call(w, tiles) for w in weights], 3, 20, use_graph=True)
        except Exception as exc:  # noqa: BLE001  (a tile the compiler or the chip rejects)
            print(f"  {name} {tiles}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        rows_out.append({"tiles": list(tiles), "us": us / copies, "rel_err": error, "current": tiles == current})
    rows_out.sort(key=lambda r: r["us"])
    floor = 2 * n * k / HBM_BYTES_PER_S * 1e6
    now = next((r["us"] for r in rows_out if r["current"]), float("nan"))
    print(f"{name:10s} rows {rows:2d}: srt's {tuple(current)} {now:.2f} us, floor {floor:.2f}; fastest:", flush=True)
    for r in rows_out[:4]:
        print(f"    {tuple(r['tiles'])}: {r['us']:.2f} us  err {r['rel_err']:.1e}", flush=True)
    return {"shape": name, "n": n, "k": k, "rows": rows, "floor_us": floor, "current_us": now, "results": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/tune_decode_gemm.json)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    results = [run_shape(name, rows) for rows in args.rows for name in args.shapes]
    write_json(args.json, "tune_decode_gemm.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
