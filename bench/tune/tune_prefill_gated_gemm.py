"""Sweep `kernels/prefill_gated_gemm.py`'s tiles against cuBLAS's gate_up GEMM + srt's gelu * up kernel.

    python bench/tune/tune_prefill_gated_gemm.py [--models E4B 31B] [--rows 2048 8192] [--out sweep.json]

Per model (the published gate_up shape: K = hidden, 2I = 2 x intermediate) and row count: the unfused path's
time (F.linear, then `gelu_tanh_mul_packed`), each tile config's time and its largest difference from the unfused
output relative to that output's largest value. CUDA events over back-to-back calls (compute-bound sizes: no L2
flush). One line per config, the fastest marked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from srt.kernels.gelu_mul import gelu_tanh_mul_packed
from srt.kernels.prefill_gated_gemm import GatedTiles, prefill_gated_applies, prefill_gelu_mlp

VARIANTS = Path(__file__).resolve().parents[2] / "srt" / "configs" / "gemma4_variants.json"
CONFIGS = [
    GatedTiles(128, 128, 64, 3, 8),
    GatedTiles(128, 128, 64, 4, 8),
    GatedTiles(128, 64, 64, 4, 4),
    GatedTiles(128, 64, 64, 4, 8),
    GatedTiles(64, 128, 64, 4, 4),
    GatedTiles(256, 64, 64, 3, 8),
    GatedTiles(128, 128, 32, 5, 8),
    GatedTiles(128, 128, 64, 3, 8, 16),
]


def time_ms(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["E4B", "31B"])
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = json.loads(VARIANTS.read_text())
    results = []
    for model in args.models:
        text = variants[f"gemma-4-{model}-it"]["text"]
        hidden, inter = text["hidden_size"], text["intermediate_size"]
        weight = (torch.randn(hidden, 2 * inter, device="cuda") / hidden**0.5).bfloat16().t()
        for rows in args.rows:
            x = torch.randn(rows, hidden, device="cuda").bfloat16()
            expected = gelu_tanh_mul_packed(F.linear(x, weight))
            unfused = time_ms(lambda x=x, weight=weight: gelu_tanh_mul_packed(F.linear(x, weight)))
            row = {"model": model, "rows": rows, "k": hidden, "inter": inter, "unfused_ms": unfused, "configs": []}
            print(f"{model} rows {rows}: cuBLAS gate_up + gelu * up {unfused:.3f} ms")
            for tiles in CONFIGS:
                if not prefill_gated_applies(x, weight, tiles):
                    continue
                try:
                    ms = time_ms(lambda x=x, tiles=tiles, weight=weight: prefill_gelu_mlp(x, weight, tiles))
                except Exception as error:  # noqa: BLE001 (a config that does not compile: shared memory, registers)
                    print(f"  {tuple(tiles)}: {type(error).__name__}")
                    continue
                diff = float((prefill_gelu_mlp(x, weight, tiles).float() - expected.float()).abs().max())
                diff /= float(expected.float().abs().max())
                row["configs"].append({"tiles": list(tiles), "ms": ms, "rel_diff": diff})
                print(f"  {tuple(tiles)}: {ms:.3f} ms ({unfused / ms:.2f}x), rel diff {diff:.1e}")
            results.append(row)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
