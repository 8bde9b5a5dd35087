"""A probe (#26): a W8A8 decode GEMM over activations quantized once per row, against srt's W8A8 kernel that
quantizes every K-step in every CTA (`srt/kernels/decode_gemm_fp8_variants.py`), at E4B's decode projections.

Why: srt's kernel quantizes x in every CTA and K-step (absmax, a multiply and a cvt per value, the tile through
shared memory to the wgmma) and scales each step's product before adding it. The probe's kernel (below; not
srt's) takes x already quantized with one scale per row over all of K (the per-token scales of FP8-dynamic
checkpoints and of the prefill GEMMs, `kernels/fp8_quant.py`): both operands go from TMA to wgmma untouched, the
MMA accumulates across K-steps (Triton's default e4m3 accumulation on sm90), and the row and column scales
multiply the float32 sum once. Result (H100, docs/benchmarks.md): ~10-15% faster on its own, slower with the
quantize kernel in front, so srt keeps its kernel.

    PYTHONPATH=. python bench/tune/tune_w8a8_rows.py [--rows 1 32] [--json out.json]

For each projection and row count: srt's W8A8 kernel (its tiles and K-chunks), the per-token quantize kernel
alone (`kernels/fp8_quant.quantize_fp8`), the row-scaled kernel over a grid of tiles and K-chunks on activations
quantized beforehand, and the fastest of those with the quantize kernel in front. LAYERS copies of each weight
(more bytes than the L2 holds) are multiplied one after the other, chained, in one CUDA graph: us per call, as in
a decode step. The floor is the FP8 weight bytes over 3.0 TB/s; the error is against the float32 product of the
bf16 input with the dequantized weight (both W8A8 forms quantize x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from srt.kernels.decode_gemm import GemmTiles, TensorDescriptor
from srt.kernels.decode_gemm_fp8_variants import decode_gelu_mlp_w8a8, decode_linear_w8a8, w8a8_splits
from srt.kernels.fp8_quant import quantize_fp8
from srt.kernels.gelu_mul import gelu_tanh_mul_packed, gelu_tanh_mul_rounded
from srt.kernels.triton_support import is_interpreted, jit, pdl_launch, pdl_start, round_to, tl, triton
from srt.layers.fp8_linear import Fp8Linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py
from timing import time_cuda, write_json  # noqa: E402
from tune_w8a8_chunks import layer  # noqa: E402  (bench/tune/: the script's own folder)

LAYERS = 12
FLOOR_BYTES_PER_S = 3.0e12
# (name, n, k, gated): n is each half's width for gated GEMMs
SHAPES = [
    ("E4B qkv (sliding)", 3072, 2560, False),
    ("E4B o (sliding)", 2560, 2048, False),
    ("E4B gate_up", 10240, 2560, True),
    ("E4B down", 2560, 10240, False),
]
# (BLOCK_N, BLOCK_K, STAGES): shared memory for 1, 2 or 3 CTAs an SM (228 KB), so that e.g. gate_up's 160 column
# blocks run in one wave rather than 132 + 28
TILES = [
    GemmTiles(64, 128, 4),
    GemmTiles(64, 128, 5),
    GemmTiles(64, 64, 6),
    GemmTiles(64, 64, 8),
    GemmTiles(128, 128, 4),
    GemmTiles(64, 256, 4),
]
SPLITS = [1, 2, 4, 8]
SMEM_LIMIT = 200 * 1024


@jit
def _w8a8_rows_kernel(
    xq_desc, w_desc, x_scale_ptr, w_scale_ptr, out_ptr, rows, n, k_per_split, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, USE_PDL: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out^T[N-block, :] = (w[N-block, K-chunk] @ xq[:, K-chunk]^T) * w_scale[N-block] * x_scale[rows] (out
    [split, rows, n]); GATED: gelu(gate) * up with the up rows at up_offset, rounded as torch."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_start = split * k_per_split
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    pdl_start(USE_PDL)  # x and its scales come from the kernel ahead
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for k in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=STAGES):
        x = xq_desc.load([0, k])
        w = w_desc.load([n0, k])
        if INTERPRETED:  # the interpreter's tl.dot of 8-bit floats is wrong; float32 products are exact
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        if GATED:
            w_up = w_desc.load([up_offset + n0, k])
            if INTERPRETED:
                acc_up = tl.dot(w_up.to(tl.float32), tl.trans(x.to(tl.float32)), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(w_up, tl.trans(x), acc_up)
    row_ok = offs_m < rows
    x_scale = tl.load(x_scale_ptr + offs_m, mask=row_ok, other=0.0)[None, :]
    acc = acc * tl.load(w_scale_ptr + offs_n)[:, None] * x_scale
    out_dtype = out_ptr.dtype.element_ty
    if GATED:  # the GEMM's two rounded outputs, then gelu_tanh_mul's rounding
        acc_up = acc_up * tl.load(w_scale_ptr + up_offset + offs_n)[:, None] * x_scale
        acc = gelu_tanh_mul_rounded(round_to(acc, out_dtype), round_to(acc_up, out_dtype), out_dtype)
    out = out_ptr + (split * rows + offs_m)[None, :] * n + offs_n[:, None]
    tl.store(out, acc.to(out_dtype), mask=row_ok[None, :])


def decode_linear_w8a8_rows(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
    tiles: GemmTiles, splits: int = 1,
) -> torch.Tensor:  # fmt: skip
    """(x_q * x_scale) @ (weight * scale)^T for x_q [rows, K] float8_e4m3fn with x_scale [rows, 1] float32 and an
    Fp8Linear's per-channel weight [N, K] and scale [N, 1]: [rows, N] in out_dtype (splits == 1) or [splits,
    rows, N] float32 partial sums."""
    rows, n = x_q.shape[0], weight.shape[0]
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    out = torch.empty(shape, dtype=out_dtype if splits == 1 else torch.float32, device=x_q.device)
    _launch(x_q, x_scale, weight, scale, out, splits, n, tiles, gated=False)
    return out


def decode_gelu_mlp_w8a8_rows(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
    tiles: GemmTiles,
) -> torch.Tensor:  # fmt: skip
    """gelu_tanh(x @ gate^T) * (x @ up^T) [rows, I] in out_dtype for a stacked gate/up Fp8Linear's weight [2I, K]
    and per-channel scale, x = x_q * x_scale as in `decode_linear_w8a8_rows`."""
    rows, n = x_q.shape[0], weight.shape[0] // 2
    out = torch.empty((rows, n), dtype=out_dtype, device=x_q.device)
    _launch(x_q, x_scale, weight, scale, out, 1, n, tiles, gated=True)
    return out


def _launch(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
            splits: int, n: int, tiles: GemmTiles, gated: bool) -> None:  # fmt: skip
    rows, k = x_q.shape
    block_m = max(16, triton.next_power_of_2(rows))
    xq_desc = TensorDescriptor.from_tensor(x_q, [block_m, tiles.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k])
    launch = pdl_launch(x_q.device, _w8a8_rows_kernel)
    _w8a8_rows_kernel[(n // tiles.block_n, splits)](
        xq_desc, w_desc, x_scale, scale, out, rows, n, k // splits, n if gated else 0,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.stages, GATED=gated,
        USE_PDL=bool(launch), INTERPRETED=is_interpreted(_w8a8_rows_kernel), num_warps=tiles.warps, **launch,
    )  # fmt: skip


def summed(out: torch.Tensor) -> torch.Tensor:
    return out.float() if out.dim() == 2 else out.sum(0)


def fits(n: int, k: int, gated: bool, tiles: GemmTiles, splits: int) -> bool:
    stage = (2 if gated else 1) * tiles.block_n * tiles.block_k + 32 * tiles.block_k
    return n % tiles.block_n == 0 and k % (splits * tiles.block_k) == 0 and stage * tiles.stages <= SMEM_LIMIT


class Shape:
    """One projection's weights at one row count: its input, reference, and the calls to time."""

    def __init__(self, name: str, gated: bool, layers: list[Fp8Linear], rows: int, results: list) -> None:
        self.name, self.gated, self.layers, self.rows, self.results = name, gated, layers, rows, results
        self.floor = 1e6 * layers[0].weight.numel() / FLOOR_BYTES_PER_S
        self.x = torch.randn(rows, layers[0].weight.shape[1], device="cuda").bfloat16()
        product = F.linear(self.x.float(), layers[0].dequantized(torch.float32))
        self.expected = gelu_tanh_mul_packed(product.bfloat16()).float() if gated else product
        self.x_q, self.x_scale = quantize_fp8(self.x)

    def record(self, what: str, us: float, err: float | None) -> None:
        print(f"{self.name} rows {self.rows}: {what:40s} {us:7.2f} us ({us / self.floor:4.2f}x floor)"
              + ("" if err is None else f" err {err:.3f}"), flush=True)  # fmt: skip
        self.results.append({"shape": self.name, "rows": self.rows, "what": what, "us": us, "floor_us": self.floor,
                             "rel_err": err})  # fmt: skip

    def rel_err(self, out: torch.Tensor) -> float:
        return float((summed(out) - self.expected).abs().max() / self.expected.abs().max())

    def us(self, call) -> float:
        chained = lambda: [call(f) for f in self.layers]  # noqa: E731
        return 1e6 * time_cuda(chained, warmup=3, repeats=30, use_graph=True) / LAYERS

    def srt(self, f: Fp8Linear) -> torch.Tensor:
        if self.gated:
            return decode_gelu_mlp_w8a8(self.x, f.weight, f.weight_scale, f.block_k)
        n, k = f.weight.shape
        return decode_linear_w8a8(self.x, f.weight, f.weight_scale, f.block_k, w8a8_splits(n, k, k))

    def quantize(self, f: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(self.x)

    def rows_kernel(self, tiles: GemmTiles, splits: int, prequantized: bool):
        def call(f: Fp8Linear) -> torch.Tensor:
            q, s = (self.x_q, self.x_scale) if prequantized else quantize_fp8(self.x)
            if self.gated:
                return decode_gelu_mlp_w8a8_rows(q, s, f.weight, f.weight_scale, self.x.dtype, tiles)
            return decode_linear_w8a8_rows(q, s, f.weight, f.weight_scale, self.x.dtype, tiles, splits)

        return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--json", type=Path, help="Results file (default $OUT/tune_w8a8_rows.json).")
    args = parser.parse_args()
    results = []
    for name, n, k, gated in SHAPES:
        layers = [layer(2 * n if gated else n, k, seed) for seed in range(LAYERS)]
        for rows in args.rows:
            shape = Shape(name, gated, layers, rows, results)
            record = shape.record
            record("srt w8a8 (per K-step)", shape.us(shape.srt), shape.rel_err(shape.srt(layers[0])))
            record("quantize per row", shape.us(shape.quantize), None)
            best = None
            for tiles in TILES:
                for splits in [1] if gated else SPLITS:
                    if not fits(n, k, gated, tiles, splits):
                        continue
                    call = shape.rows_kernel(tiles, splits, prequantized=True)
                    try:
                        us, err = shape.us(call), shape.rel_err(call(layers[0]))
                    except Exception as e:  # a config that does not compile: reported, the sweep goes on
                        print(f"{name} rows {rows}: {tiles} x {splits}: failed {type(e).__name__}: {e}"[:300])
                        continue
                    record(f"rows {tuple(tiles)} x {splits}", us, err)
                    if best is None or us < best[0]:
                        best = (us, tiles, splits)
            if best is not None:
                call = shape.rows_kernel(best[1], best[2], prequantized=False)
                record(f"quantize + rows {tuple(best[1])} x {best[2]}", shape.us(call), shape.rel_err(call(layers[0])))
        del layers
        torch.cuda.empty_cache()
    write_json(args.json, "tune_w8a8_rows.json", {"device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
