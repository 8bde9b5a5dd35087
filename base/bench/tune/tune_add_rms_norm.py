"""Warps of the residual add + RMSNorm kernel (`add_rms_norm_then_norm`) by row count, bf16, one GPU.

    PYTHONPATH=. python bench/tune/tune_add_rms_norm.py [--hidden 2560 1536] [--rows 1 8 32]

A step runs ~3 of these per layer; at decode each is latency bound (a few KB per row), at prefill sizes
(--rows 1024 8192) bandwidth bound. For each hidden size and row count, a CUDA graph of LAYERS calls is timed
per warp count (`norm_kernels.add_norm_warps` patched); the table gives microseconds per call. Results go to
--json, or to $OUT/tune_add_rms_norm.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from srt.kernels import norm as norm_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py and friends
from timing import time_cuda, write_json  # noqa: E402

LAYERS = 42
WARPS = (1, 2, 4, 8, 16)


def time_call(hidden: int, rows: int, warps: int) -> float:
    bf16, device = torch.bfloat16, torch.device("cuda")
    xs = [torch.randn(rows, hidden, device=device, dtype=bf16) for _ in range(LAYERS)]
    residual = torch.randn(rows, hidden, device=device, dtype=bf16)
    weight, next_weight = (torch.randn(hidden, device=device, dtype=bf16) for _ in range(2))
    scale = torch.ones(1, device=device, dtype=bf16)
    norm_kernels.add_norm_warps = lambda block, rows: warps
    step = lambda: [  # noqa: E731
        norm_kernels.add_rms_norm_then_norm(x, residual, weight, 1e-6, next_weight, 1e-6, scale) for x in xs
    ]
    return 1e6 * time_cuda(step, warmup=5, repeats=50, use_graph=True) / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", nargs="+", type=int, default=[2560, 1536])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    default = norm_kernels.add_norm_warps
    print(f"{torch.cuda.get_device_name()}: us per add + norm + next norm, graph of {LAYERS}")
    print(f"{'hidden':>6} {'rows':>4} {'default':>7} " + " ".join(f"{f'{w} warps':>8}" for w in WARPS))
    results = []
    for hidden in args.hidden:
        for rows in args.rows:
            us = {warps: time_call(hidden, rows, warps) for warps in WARPS}
            chosen = default(triton_block := 1 << (hidden - 1).bit_length(), rows)
            results.append({"hidden": hidden, "rows": rows, "block": triton_block, "default_warps": chosen, "us": us})
            print(f"{hidden:>6} {rows:>4} {chosen:>7} " + " ".join(f"{us[w]:>8.2f}" for w in WARPS), flush=True)
    payload = {"device": torch.cuda.get_device_name(), "results": results}
    write_json(args.json, "tune_add_rms_norm.json", payload, indent=2)


if __name__ == "__main__":
    main()
