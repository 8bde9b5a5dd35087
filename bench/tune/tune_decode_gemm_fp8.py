"""Tiles and kernel variants of srt's FP8 decode GEMM (`srt/kernels/decode_gemm_fp8.py`) at Gemma 4's decode
projections, on Hopper (#26). On an H100, about 2.5 minutes (30 s of parallel compiles, then a line per
projection and rows as it goes):

    python3 bench/tune/tune_decode_gemm_fp8.py --out $OUT/tune-decode-gemm-fp8-h100.json
    python3 bench/tune/tune_decode_gemm_fp8.py --models E4B --rows 32 --variants fp8 swap_bf16   # narrower
    TRITON_INTERPRET=1 python3 bench/tune/tune_decode_gemm_fp8.py --smoke    # CPU: tiny shapes vs the reference

What runs (`fp8_decode_plan.py`): the dense decode projections of E4B, 26B-A4B and 31B from their configs
(q/k/v stacked, o, gate_up with gelu * up in the epilogue, down; 26B-A4B's experts are not dense projections),
at 1 and 32 rows, each as srt calls it in a decode step:

- each kernel family's tiles (BLOCK_N, BLOCK_K, STAGES, warps): "fp8", the weight-only kernel (weights upcast to
  bf16; srt's decode path before the sweep, its fallback since), and
  the variants of `srt/kernels/decode_gemm_fp8_variants.py` ("fp16", "swap_fp16", "w8a8"; "swap_bf16" on
  request), first at the caller's 4 K-splits (and the fewest splits that give a full wave of CTAs), then the 2
  fastest tiles of each family at every splits count in (1, 2, 3, 4, 6, 8) that divides K (gate_up too for the
  variants, whose kernel sums a gated GEMM's K-chunks);
- srt's bf16 decode GEMM (`decode_gemm.py`, its own tiles) and cuBLAS's (F.linear), on the weight in bf16;
- torch._scaled_mm W8A8 (x quantized per token by srt's `kernels/fp8_quant.py`, per-channel weight scales),
  with and without the quantize kernel; "fp8 srt" is srt's FP8 path before the sweep: the weight-only kernel
  and tiles, or this _scaled_mm where its tiles do not divide the shape (srt now runs "w8a8" with the tiles of
  `decode_gemm_fp8_variants.W8A8_TILES`, chosen from this sweep's 2026-11-26 run);
- the floor: FP8 weight and scale bytes over the copy bandwidth measured as `bench/floors.py` does (bytes read
  and written by a 1 GiB device copy), and over a nominal 3.35 TB/s.

Timing as bench/tune/tune_decode_gemm.py: a CUDA graph chains the calls over enough weight copies to overflow
L2, so each streams its weight from HBM behind the one ahead (the Triton kernels chained by PDL, cuBLAS not),
median of 10 replays over the copies. Every config's error against the float32 product with the dequantized
weight is recorded; a config that fails to compile, exceeds shared memory or errs beyond its family's bound is
recorded as failed, and the sweep goes on.

Output: a JSON (--out, else $OUT/tune-decode-gemm-fp8.json; rewritten after each projection, "complete" at the
end) with every config's microseconds and error, the PTX instruction counts of its kernel (conversions, MMA
kind), and each model's projections summed over a decode step; printed: the fastest config per (projection,
rows) with its speed-up over srt's bf16 GEMM, the per-step sums, and the PTX counts of each family's fastest
kernel at the largest projection.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # srt, bench/
from floors import measure_device_rates  # noqa: E402
from fp8_decode_plan import (  # noqa: E402
    DEFAULT_FAMILIES,
    FAMILIES,
    MODELS,
    SMOKE_TILES,
    SPLITS_GRID,
    TILE_GRID,
    Config,
    Projection,
    compile_key,
    first_splits,
    fits,
    fp8_call,
    precompile,
    projections,
    smoke_projections,
)
from timing import time_cuda, write_json  # noqa: E402

from srt.kernels.decode_gemm import GATED, GemmTiles, decode_gelu_mlp, decode_gemm_applies, decode_linear  # noqa: E402
from srt.kernels.decode_gemm_fp8 import _decode_gemm_fp8_kernel, decode_fp8_tiles  # noqa: E402
from srt.kernels.decode_gemm_fp8_variants import VARIANTS, _decode_gemm_fp8_variant_kernel  # noqa: E402
from srt.kernels.fp8_quant import quantize_fp8  # noqa: E402
from srt.kernels.gelu_mul import gelu_tanh_mul_packed  # noqa: E402
from srt.layers.fp8_linear import Fp8Linear  # noqa: E402
from srt.layers.linear import TRITON_SPLITS  # noqa: E402
from srt.model_loader.fp8 import Fp8Scheme, quantize  # noqa: E402

# relative error bounds (max |error| / max |expected|): weight-only products round once to bf16 (or sum float32
# partials); W8A8 adds the activations' e4m3 rounding (3 mantissa bits) per value
ERROR_BOUNDS = {"w8a8": 0.08}
WEIGHT_ONLY_BOUND = 0.02
L2_OVERFLOW_BYTES = 256 * 1024**2
NOMINAL_HBM_BYTES_PER_S = 3.35e12
TOP_FOR_SPLITS = 2  # fastest tiles of each family that are retimed at every splits count


def fp8_layers(projection: Projection, copies: int, scales: str, device: torch.device) -> list[Fp8Linear]:
    """`copies` Fp8Linears of the projection's shape (one random weight quantized, then cloned)."""
    n, k = projection.n, projection.k
    weight = torch.randn(n, k, device=device) / k**0.5
    q, scale = quantize(weight, Fp8Scheme(scales))
    layers = []
    for _ in range(copies):
        layer = Fp8Linear(k, n, None if scales == "channel" else (128, 128), device=device)
        layer.weight.copy_(q)
        layer.weight_scale.copy_(layer.scale_from_checkpoint(scale))
        layers.append(layer)
    return layers


# PTX instructions counted in each kernel the sweep runs (static counts: a pipelined loop body appears a few
# times), which show what a weight tile costs besides its bytes: conversions, the MMA kind, shared-memory traffic
PTX_OPS = {
    "cvt_e4m3x2_to_f16x2": "cvt.rn.f16x2.e4m3x2",
    "cvt_f16_to_bf16": "cvt.bf16.f16",
    "cvt_f32_to_bf16": "cvt.rn.bf16.f32",
    "cvt_to_e4m3x2": "cvt.rn.satfinite.e4m3x2",
    "mma_sync": "mma.sync",
    "wgmma": "wgmma.mma_async",
    "ldmatrix": "ldmatrix",
    "ld_shared": "ld.shared",
    "st_shared": "st.shared",
}


class KernelPtx:
    """PTX counts (`PTX_OPS`) of the kernel behind each compile key, taken from Triton's in-process cache when a
    call first loads it (GPU only)."""

    def __init__(self) -> None:
        self.counts: dict[tuple, dict[str, int]] = {}

    def capture(self, key: tuple, call: Callable[[], object]) -> object:
        kernel = _decode_gemm_fp8_kernel if key[0] == "fp8" else _decode_gemm_fp8_variant_kernel
        cache = kernel.device_caches[torch.cuda.current_device()][0]
        before = set(cache)
        out = call()
        new = [cache[k] for k in set(cache) - before]
        if key not in self.counts and len(new) == 1:
            lines = new[0].asm.get("ptx", "").splitlines()
            self.counts[key] = {name: sum(op in line for line in lines) for name, op in PTX_OPS.items()}
        return out


class Timer(NamedTuple):
    device: torch.device
    smoke: bool

    def us(self, call: Callable[[object], object], weights: list) -> float:
        """Microseconds of one call: median over a graph of calls that stream `weights` one after the other."""
        if self.smoke:  # the interpreter: one call, to exercise the path
            return 1e6 * time_cuda(lambda: call(weights[0]), warmup=0, repeats=1, device=self.device)
        seconds = time_cuda(lambda: [call(w) for w in weights], warmup=2, repeats=10, use_graph=True)
        return 1e6 * seconds / len(weights)


def summed_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |error| over max |expected|, partial sums ([splits, rows, N]) summed first."""
    out = out.sum(0) if out.dim() == 3 else out
    return float((out.float() - expected).abs().max() / expected.abs().max())


class ProjectionSweep:
    """The configs of one (projection, rows): its weights, input and reference, and where the time went."""

    def __init__(self, projection: Projection, rows: int, layers: list[Fp8Linear], timer: Timer,
                 failed_compiles: dict, ptx: KernelPtx) -> None:  # fmt: skip
        self.projection, self.rows, self.layers, self.timer = projection, rows, layers, timer
        self.failed_compiles, self.ptx = failed_compiles, ptx
        self.x = torch.randn(rows, projection.k, device=timer.device).bfloat16()
        product = F.linear(self.x.float(), layers[0].dequantized(torch.float32))
        self.gated = projection.kind == GATED
        self.expected = gelu_tanh_mul_packed(product.bfloat16()).float() if self.gated else product
        self.seconds = {"baselines": 0.0, "first calls": 0.0, "timing": 0.0}  # first calls: loading kernels
        current = decode_fp8_tiles(projection.kind, projection.out_n, projection.k, layers[0].block_k)
        self.srt_splits = 1 if self.gated else TRITON_SPLITS
        divides = current and not (
            projection.out_n % current.block_n or projection.k % (self.srt_splits * current.block_k)
        )
        # None where srt's tiles do not divide the shape: `decode_fp8_applies` sends it to fp8_linear
        self.srt_tiles = current if divides else None

    def family(self, family: str, grid: list[GemmTiles]) -> list[dict]:
        """Every tile of `grid` at its first splits (srt's own tiles first, for "fp8"), then the fastest
        TOP_FOR_SPLITS at every splits count that fits."""
        block_k = self.layers[0].block_k
        first = [Config(family, self.srt_tiles, self.srt_splits)] if family == "fp8" and self.srt_tiles else []
        first += [Config(family, t, s) for t in grid for s in first_splits(self.projection, t, block_k, family)]
        timed = [self.timed(c) for c in dict.fromkeys(first)]
        fastest = sorted((c for c in timed if c["us"] is not None), key=lambda c: c["us"])[:TOP_FOR_SPLITS]
        more = [
            Config(family, GemmTiles(*c["tiles"]), s)
            for c in fastest
            for s in SPLITS_GRID
            # gated K-chunks: the variants' kernel sums them (srt's E4B gate_up runs 160 programs, 1.2 waves)
            if (not self.gated or family in VARIANTS)
            and fits(self.projection, GemmTiles(*c["tiles"]), s, block_k, family)
        ]
        timed += [self.timed(c) for c in dict.fromkeys(more) if c not in first]
        for c in timed:
            c["srt_default"] = (
                family == "fp8" and self.srt_tiles == tuple(c["tiles"]) and c["splits"] == self.srt_splits
            )
        return timed

    def timed(self, config: Config) -> dict:
        """One config's microseconds and error, or why it has none."""
        entry = {"family": config.family, "tiles": list(config.tiles), "splits": config.splits}
        key = compile_key(config, self.projection, self.rows, self.layers[0].block_k)
        if key in self.failed_compiles:
            return {**entry, "us": None, "error": self.failed_compiles[key]}
        call = lambda layer: fp8_call(config.family, self.x, layer, self.projection.kind, config)  # noqa: E731
        try:
            started = time.perf_counter()
            first = call(self.layers[0]) if self.timer.smoke else self.ptx.capture(key, lambda: call(self.layers[0]))
            error = summed_error(first, self.expected)
            self.seconds["first calls"] += time.perf_counter() - started
            if not error <= ERROR_BOUNDS.get(config.family, WEIGHT_ONLY_BOUND):
                return {**entry, "us": None, "rel_err": error, "error": "wrong result"}
            started = time.perf_counter()
            us = self.timer.us(call, self.layers)
            self.seconds["timing"] += time.perf_counter() - started
            return {**entry, "us": us, "rel_err": error, "ptx": self.ptx.counts.get(key)}
        except Exception as exc:  # noqa: BLE001  (a tile the compiler or the chip rejects)
            return {**entry, "us": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def run_projection(projection: Projection, rows: int, families: list[str], grid: list[GemmTiles], scales: str,
                   timer: Timer, copy_bytes_per_s: float, failed_compiles: dict, ptx: KernelPtx) -> dict:  # fmt: skip
    """Every config of `families` at one (projection, rows), the baselines beside them, the fastest configs."""
    n, k = projection.n, projection.k
    fp8_bytes = n * k + n * (1 if scales == "channel" else -(-k // 128)) * 4
    copies = 1 if timer.smoke else max(4, -(-L2_OVERFLOW_BYTES // fp8_bytes))
    sweep = ProjectionSweep(projection, rows, fp8_layers(projection, copies, scales, timer.device), timer,
                            failed_compiles, ptx)  # fmt: skip
    result = {
        "model": projection.model, "shape": projection.name, "n": n, "k": k, "rows": rows,
        "kind": "gated" if sweep.gated else f"{projection.kind} splits", "per_step": projection.per_step,
        "floor_us": fp8_bytes / copy_bytes_per_s * 1e6, "floor_nominal_us": fp8_bytes / NOMINAL_HBM_BYTES_PER_S * 1e6,
        "floor_bf16_us": 2 * n * k / copy_bytes_per_s * 1e6,
    }  # fmt: skip
    started = time.perf_counter()
    result.update(baselines(projection, sweep.x, sweep.layers, sweep.expected, timer))
    sweep.seconds["baselines"] = time.perf_counter() - started
    result["configs"] = configs = [c for family in families for c in sweep.family(family, grid)]
    result["seconds"] = sweep.seconds
    ok = [c for c in configs if c["us"] is not None]
    # what srt runs today: the chained FP8 GEMM with its tiles where they apply, else (per-channel) _scaled_mm
    result["srt_fp8_us"] = next((c["us"] for c in ok if c["srt_default"]), None)
    if sweep.srt_tiles is None and scales == "channel":
        result["srt_fp8_us"] = result.get("scaled_mm_with_quant_us")
    result["best"] = min(ok, key=lambda c: c["us"], default=None)
    result["best_weight_only"] = min((c for c in ok if c["family"] != "w8a8"), key=lambda c: c["us"], default=None)
    result["best_per_family"] = {
        f: min((c for c in ok if c["family"] == f), key=lambda c: c["us"], default=None) for f in families
    }
    return result


def baselines(projection: Projection, x: torch.Tensor, layers: list[Fp8Linear], expected: torch.Tensor,
              timer: Timer) -> dict:  # fmt: skip
    """srt's bf16 decode GEMM and cuBLAS on the weight in bf16, and torch._scaled_mm W8A8 (per-token x scales
    from srt's quantizer, per-channel weight scales): microseconds (None where it does not run) and errors."""
    gated, splits = projection.kind == GATED, projection.kind
    bf16 = layers[0].dequantized(torch.bfloat16)
    copies = 1 if timer.smoke else max(4, -(-L2_OVERFLOW_BYTES // bf16.nbytes))
    weights = [bf16.t().contiguous().t() for _ in range(copies)]  # stored transposed, as srt stores them
    finish = gelu_tanh_mul_packed if gated else (lambda y: y)
    calls = {"bf16_cublas": lambda w: finish(F.linear(x, w))}
    if decode_gemm_applies(x, weights[0], GATED if gated else splits):  # srt has tiles for the shape (and TMA)
        calls["bf16_triton"] = (lambda w: decode_gelu_mlp(x, w)) if gated else (lambda w: decode_linear(x, w, splits))
    out = {}
    for name, call in calls.items():
        out[name + "_us"] = _try_us(timer, call, weights)
    del weights
    if layers[0].block is None:  # _scaled_mm takes one scale per row and column only
        scale_b = [layer.weight_scale.view(1, -1) for layer in layers]

        def scaled_mm(pair: tuple[torch.Tensor, torch.Tensor], quantized: tuple | None = None) -> torch.Tensor:
            xq, x_scale = quantized or quantize_fp8(x)
            weight, w_scale = pair
            return finish(torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype))

        pairs = [(layer.weight, s) for layer, s in zip(layers, scale_b)]
        out["scaled_mm_with_quant_us"] = _try_us(timer, scaled_mm, pairs)
        quantized = quantize_fp8(x) if out["scaled_mm_with_quant_us"] is not None else None
        out["scaled_mm_us"] = _try_us(timer, lambda p: scaled_mm(p, quantized), pairs) if quantized else None
        if quantized is not None:
            out["scaled_mm_rel_err"] = summed_error(scaled_mm(pairs[0]), expected)
    return out


def _try_us(timer: Timer, call: Callable[[object], object], weights: list) -> float | None:
    try:
        return timer.us(call, weights)
    except Exception as exc:  # noqa: BLE001  (cuBLAS or torch refusing a shape, a CPU without the op)
        print(f"    baseline failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def _fmt(us: float | None) -> str:
    return f"{us:7.2f}" if us is not None else "      -"


def print_row(r: dict) -> None:
    """One line of the table: the floor, the bf16 GEMMs, srt's FP8 GEMM, the fastest config (and its speed-up over
    srt's bf16 GEMM, else cuBLAS's) and torch._scaled_mm (without / with the quantize kernel)."""
    best, bf16 = r["best"], r.get("bf16_triton_us") or r.get("bf16_cublas_us")
    speedup = f"{bf16 / best['us']:.2f}x" if best and bf16 else "-"
    where = f"{best['family']} {tuple(best['tiles'])} s{best['splits']}" if best else "none ran"
    cells = [
        f"{r['model']:8s} {r['shape']:16s} r{r['rows']:<3d} floor {_fmt(r['floor_us'])}",
        f"bf16 {_fmt(r.get('bf16_triton_us'))} cublas {_fmt(r.get('bf16_cublas_us'))}",
        f"fp8 srt {_fmt(r['srt_fp8_us'])}",
        f"best {_fmt(best and best['us'])} {where:32s} {speedup:>6s}",
        f"scaled_mm {_fmt(r.get('scaled_mm_us'))} +q {_fmt(r.get('scaled_mm_with_quant_us'))}",
    ]
    print(" | ".join(cells), flush=True)


def step_totals(results: list[dict], families: list[str]) -> dict:
    """Each model's projections summed over one decode step (per_step x us), per rows: the bf16 GEMM, srt's FP8
    GEMM, each family's fastest config per shape, and the fastest of all."""
    totals: dict = {}
    for r in results:
        entry = totals.setdefault(r["model"], {}).setdefault(f"rows {r['rows']}", {})
        picks = {
            "bf16": r.get("bf16_triton_us") or r.get("bf16_cublas_us"),
            "fp8_srt": r["srt_fp8_us"],
            "best": r["best"] and r["best"]["us"],
            "floor_fp8": r["floor_us"],
            "floor_bf16": r["floor_bf16_us"],
        }
        picks.update({f: c and c["us"] for f, c in r["best_per_family"].items()})
        for name, us in picks.items():
            total = entry.get(name, 0.0)  # None once a shape has no time
            entry[name] = None if total is None or us is None else total + r["per_step"] * us
    return totals


def print_ptx(results: list[dict]) -> None:
    """PTX counts of each family's fastest kernel at the projection with the most weight bytes per step, per rows."""
    for rows in sorted({r["rows"] for r in results}):
        at_rows = [r for r in results if r["rows"] == rows]
        top = max(at_rows, key=lambda r: r["per_step"] * r["floor_us"])
        print(f"PTX of each family's fastest kernel at {top['model']} {top['shape']} rows {rows}:")
        for family, c in top["best_per_family"].items():
            if c and c.get("ptx"):
                print(f"  {family:10s} {tuple(c['tiles'])}: " + " ".join(f"{k} {v}" for k, v in c["ptx"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the JSON (default: $OUT/tune-decode-gemm-fp8.json)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_FAMILIES), choices=FAMILIES)
    parser.add_argument(
        "--scales",
        default="channel",
        choices=("channel", "block"),
        help="per-channel (--quantization fp8) or 128 x 128 block scales (FP8 checkpoints)",
    )
    parser.add_argument("--compile-timeout", type=float, default=150.0, help="seconds for the parallel compile")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes, one tile")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, grid, work, families, copy_rate, failed = setup(args)
    out = args.out or (Path(os.environ["OUT"]) / "tune-decode-gemm-fp8.json" if os.environ.get("OUT") else None)
    payload = {
        "device": str(torch.cuda.get_device_name()) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "scales": args.scales, "copy_bytes_per_s": copy_rate, "families": families,
        "complete": False, "results": [],
    }  # fmt: skip
    start, timer, ptx, results = time.perf_counter(), Timer(device, args.smoke), KernelPtx(), payload["results"]
    for i, (projection, rows) in enumerate(work, 1):
        results.append(run_projection(projection, rows, families, grid, args.scales, timer, copy_rate, failed, ptx))
        seconds = " ".join(f"{k} {v:.0f}" for k, v in results[-1]["seconds"].items())
        print(f"[{i}/{len(work)} {time.perf_counter() - start:.0f} s; {seconds}]", flush=True)
        print_row(results[-1])
        if out is not None:  # after each projection: a run cut short keeps what it measured
            out.write_text(json.dumps(payload, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload["step_totals_us"] = totals = step_totals(results, families)
    print("\nprojections per decode step (us; per_step x each shape's fastest config of the family):")
    for model, per_rows in totals.items():
        for rows, entry in per_rows.items():
            print(f"  {model:8s} {rows:8s} " + "  ".join(f"{k} {_fmt(v).strip()}" for k, v in entry.items()))
    print_ptx(results)
    payload["complete"] = True
    write_json(out, "tune-decode-gemm-fp8.json", payload)
    if args.smoke:
        smoke_verdict(results)


def setup(args: argparse.Namespace) -> tuple:
    """(device, tile grid, [(projection, rows)], families, copy bandwidth, {compile key: error}) of the run."""
    if args.smoke:
        _interpreter_scalars_as_item()
        work = [(p, 3) for p in smoke_projections()]
        return torch.device("cpu"), SMOKE_TILES, work, list(FAMILIES), NOMINAL_HBM_BYTES_PER_S, {}
    import triton

    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    copy_rate = measure_device_rates(device, torch.bfloat16).copy_bytes_per_s
    print(f"copy bandwidth {copy_rate / 1e12:.2f} TB/s (read + written)", flush=True)
    work = [(p, rows) for m in args.models for rows in args.rows for p in projections(m)]
    failed = precompile(work, args.variants, TILE_GRID, args.scales, args.compile_timeout)
    return device, TILE_GRID, work, list(args.variants), copy_rate, failed


def smoke_verdict(results: list[dict]) -> None:
    """Print each smoke config's error against the dequantized reference; exit non-zero unless all ran within
    their family's bound."""
    configs = [(r["shape"], c) for r in results for c in r["configs"]]
    for shape, c in configs:
        outcome = f"rel_err {c['rel_err']:.2e}" if c["us"] is not None else f"FAILED {c.get('error')}"
        print(f"smoke {shape:16s} {c['family']:10s} {tuple(c['tiles'])} splits {c['splits']}: {outcome}")
    if not configs or any(c["us"] is None for _, c in configs):
        print("smoke FAILED")
        sys.exit(1)
    print("smoke ok")


def _interpreter_scalars_as_item() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays, whose int() NumPy >= 2.4 refuses inside
    range(): convert through .item() (test/conftest.py does the same for the tests)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    main()
