"""Tiles and K-chunks of srt's CUDA-core FP8 projection for 1-4 rows (`srt/kernels/decode_gemv_fp8.py`) at Gemma 4's
dense decode projections, against the W8A8 tensor-core kernel srt ran there before (#26). On an H100, a few
minutes:

    python3 bench/tune/tune_decode_gemv_fp8.py --out $OUT/tune-decode-gemv-fp8-h100.json
    python3 bench/tune/tune_decode_gemv_fp8.py --models E4B --rows 1     # narrower

Per (projection, rows): the FP8 bytes' floor over the measured copy bandwidth, the W8A8 GEMM as `layers/linear.py`
called it before the float16 products (`w8a8_splits` K-chunks, its tiles), and every GEMV config of the grid
(BLOCK_N, BLOCK_K, warps, and for partial sums every K-chunk count that divides), timed as
`tune_decode_gemm_fp8.py` times (a CUDA graph of chained calls over weight copies that overflow L2, median of 10
replays), each checked against the dequantized product first. Printed: the fastest GEMV per projection, and per
model and rows the decode step's projections summed (W8A8, each shape's fastest GEMV, srt's tiles and K-chunks,
and each single tile at its best K-chunks per shape); `--srt-tiles` times srt's tiles (`gemv_tiles`) at every
K-chunk count instead of the grid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # srt, bench/
from floors import measure_device_rates  # noqa: E402
from fp8_decode_plan import MODELS, Projection, projections  # noqa: E402
from timing import write_json  # noqa: E402
from tune_decode_gemm_fp8 import L2_OVERFLOW_BYTES, Timer, fp8_layers, summed_error  # noqa: E402

from srt.kernels.decode_gemm import GATED  # noqa: E402
from srt.kernels.decode_gemm_fp8_variants import (  # noqa: E402
    decode_gelu_mlp_w8a8,
    decode_linear_w8a8,
    decode_w8a8_applies,
    w8a8_splits,
)
from srt.kernels.decode_gemv_fp8 import (  # noqa: E402
    GemvTiles,
    decode_gelu_mlp_gemv,
    decode_linear_gemv,
    gemv_fits,
    gemv_splits,
    gemv_tiles,
)
from srt.kernels.gelu_mul import gelu_tanh_mul_packed  # noqa: E402

# the first sweep of 2026-11-27 (tune-decode-gemv-fp8-h100-first.json; the kernel also loaded the next K-step by
# hand then, "stages 0", since dropped): Triton's pipeline beat that at every shape (E4B's step 2.3 -> 1.8 ms at one
# row), 4 warps beat 8, BLOCK_K 1024 never won, 4 stages beat 2
GRID = [GemvTiles(n, k, 4, s) for n in (8, 16, 32) for k in (256, 512) for s in (4, 6, 8)]
SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
MAX_ACC_PER_THREAD = 128  # float32 accumulators a thread may hold (rows x BLOCK_N x BLOCK_K x halves / threads)
BOUND = 1e-2  # bf16 outputs (one rounding); partial sums are far closer
W8A8_BOUND = 0.08  # W8A8: the activations' e4m3 rounding besides


def fits(tiles: GemvTiles, projection: Projection, rows: int, splits: int) -> bool:
    """The kernel's shape rules (`gemv_fits`) and a register budget for the accumulators."""
    halves = 2 if projection.kind == GATED else 1
    rows_p2 = 1 << (rows - 1).bit_length()
    registers = rows_p2 * tiles.block_n * tiles.block_k * halves / (32 * tiles.warps)
    kind = GATED if projection.kind == GATED else splits
    return registers <= MAX_ACC_PER_THREAD and gemv_fits(rows, projection.n, projection.k, projection.k, kind, tiles)


def run_projection(projection: Projection, rows: int, timer: Timer, copy_rate: float, grid: list[GemvTiles]) -> dict:
    n, k = projection.n, projection.k
    gated = projection.kind == GATED
    fp8_bytes = n * k + 4 * n
    layers = fp8_layers(projection, max(4, -(-L2_OVERFLOW_BYTES // fp8_bytes)), "channel", timer.device)
    x = torch.randn(rows, k, device=timer.device).bfloat16()
    product = F.linear(x.float(), layers[0].dequantized(torch.float32))
    expected = gelu_tanh_mul_packed(product.bfloat16()).float() if gated else product
    result = {
        "model": projection.model, "shape": projection.name, "n": n, "k": k, "rows": rows, "gated": gated,
        "per_step": projection.per_step, "floor_us": fp8_bytes / copy_rate * 1e6, "configs": [],
    }  # fmt: skip

    def timed(call, bound: float = BOUND) -> tuple[float | None, float | None, str | None]:
        try:
            err = summed_error(call(layers[0]), expected)
            if not err <= bound:
                return None, err, "wrong result"
            return timer.us(call, layers), err, None
        except Exception as exc:  # noqa: BLE001  (a config the compiler or the chip rejects)
            return None, None, f"{type(exc).__name__}: {str(exc)[:160]}"

    block_k = layers[0].block_k
    if gated:
        w8a8 = decode_w8a8_applies(x, layers[0].weight, block_k, GATED) and (
            lambda layer: decode_gelu_mlp_w8a8(x, layer.weight, layer.weight_scale, layer.block_k)
        )
    else:
        s = w8a8_splits(n, k, block_k)
        w8a8 = decode_w8a8_applies(x, layers[0].weight, block_k, s) and (
            lambda layer: decode_linear_w8a8(x, layer.weight, layer.weight_scale, layer.block_k, s)
        )
    result["w8a8_us"] = timed(w8a8, W8A8_BOUND)[0] if w8a8 else None
    srt_tiles = gemv_tiles(n // 2 if gated else n, k, gated)
    result["srt_tiles"] = list(srt_tiles)
    for tiles in grid or [srt_tiles]:
        for splits in (1,) if gated else SPLITS:
            if not fits(tiles, projection, rows, splits):
                continue
            if gated:
                call = lambda layer, t=tiles: decode_gelu_mlp_gemv(x, layer.weight, layer.weight_scale, t)  # noqa: E731
            else:
                call = lambda layer, t=tiles, s=splits: decode_linear_gemv(  # noqa: E731
                    x, layer.weight, layer.weight_scale, s, t
                )
            us, err, why = timed(call)
            result["configs"].append({"tiles": list(tiles), "splits": splits, "us": us, "rel_err": err, "error": why})
    ok = [c for c in result["configs"] if c["us"] is not None]
    result["best"] = min(ok, key=lambda c: c["us"], default=None)
    return result


def per_step(results: list[dict], grid: list[GemvTiles]) -> dict:
    """Per model and rows: W8A8, each shape's fastest GEMV, srt's (its tiles and K-chunks per shape), the floor, and
    each tile of the grid at its best splits per shape."""
    totals: dict = {}
    for r in results:
        entry = totals.setdefault(
            f"{r['model']} rows {r['rows']}", {"w8a8": 0.0, "gemv_best": 0.0, "srt": 0.0, "floor": 0.0}
        )
        srt_splits = 1 if r["gated"] else gemv_splits(r["n"], r["k"])
        srt = [c["us"] for c in r["configs"] if c["tiles"] == r["srt_tiles"] and c["splits"] == srt_splits]
        entry["srt"] += r["per_step"] * (srt[0] if srt and srt[0] is not None else float("inf"))
        entry["floor"] += r["per_step"] * r["floor_us"]
        entry["w8a8"] = (
            None if entry["w8a8"] is None or r["w8a8_us"] is None else entry["w8a8"] + r["per_step"] * r["w8a8_us"]
        )
        entry["gemv_best"] += r["per_step"] * (r["best"]["us"] if r["best"] else float("inf"))
        for tiles in grid:
            us = [c["us"] for c in r["configs"] if c["us"] is not None and c["tiles"] == list(tiles)]
            key = "tile " + "x".join(map(str, tiles))
            entry[key] = entry.get(key, 0.0) + r["per_step"] * (min(us) if us else float("inf"))
    return totals


PTX_OPS = ("st.shared", "ld.shared", "cvt.rn.f16x2.e4m3x2", "fma.rn.f32", "ld.global.v4", "ld.global.nc.v4", "bar.sync")


def ptx_summary() -> list[dict]:
    """Instruction counts (static) and shared memory of every GEMV kernel compiled in this process: whether the
    weights' layout was converted through shared memory, and what a K-step costs."""
    from srt.kernels.decode_gemv_fp8 import _fp8_gemv_kernel

    summary = []
    for kernel in _fp8_gemv_kernel.device_caches[torch.cuda.current_device()][0].values():
        ptx = kernel.asm.get("ptx", "")
        counts = {op: ptx.count(op) for op in PTX_OPS}
        meta = kernel.metadata
        registers = {"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None)}
        summary.append({"name": kernel.name, "shared": meta.shared, "warps": meta.num_warps, **registers, **counts})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the JSON (default: $OUT/tune-decode-gemv-fp8.json)")
    parser.add_argument("--models", nargs="+", default=["E4B", "31B"], choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--srt-tiles", action="store_true", help="srt's tiles per shape (gemv_tiles) only, no grid")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    copy_rate = measure_device_rates(device, torch.bfloat16).copy_bytes_per_s
    print(torch.cuda.get_device_name(), f"copy bandwidth {copy_rate / 1e12:.2f} TB/s", flush=True)
    out = args.out or (Path(os.environ["OUT"]) / "tune-decode-gemv-fp8.json" if os.environ.get("OUT") else None)
    payload = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_rate, "results": []}
    timer, start = Timer(device, smoke=False), time.perf_counter()
    grid = [] if args.srt_tiles else GRID
    for model in args.models:
        for rows in args.rows:
            for projection in projections(model):
                r = run_projection(projection, rows, timer, copy_rate, grid)
                payload["results"].append(r)
                best = r["best"]
                where = f"{tuple(best['tiles'])} s{best['splits']} {best['us']:7.2f}" if best else "none ran"
                w8a8 = f"{r['w8a8_us']:7.2f}" if r["w8a8_us"] else "      -"
                print(f"[{time.perf_counter() - start:4.0f} s] {model:8s} {projection.name:16s} r{rows} "
                      f"floor {r['floor_us']:7.2f} w8a8 {w8a8} gemv {where}", flush=True)  # fmt: skip
                if out is not None:
                    out.write_text(json.dumps(payload, indent=1))
                torch.cuda.empty_cache()
    payload["per_step_us"] = totals = per_step(payload["results"], grid)
    print("\nprojections per decode step (us):")
    for key, entry in totals.items():
        fixed = sorted((v, k) for k, v in entry.items() if k.startswith("tile"))[:4]
        sums = f"floor {entry['floor']:8.1f} w8a8 {entry['w8a8'] or 0:8.1f} gemv best {entry['gemv_best']:8.1f}"
        sums += f" srt {entry['srt']:8.1f}"
        print(f"  {key:14s} {sums}  single tiles: " + ", ".join(f"{k[5:]} {v:.1f}" for v, k in fixed))
    payload["ptx"] = ptx_summary()
    for entry in payload["ptx"][:12]:
        print("  ptx", entry)
    write_json(out, "tune-decode-gemv-fp8.json", payload)


if __name__ == "__main__":
    main()
