"""Which decode GEMMs may be chained to the kernel ahead (srt/layers/cublas_chain.py), on this GPU and cuBLAS.

For each E4B decode projection at 1, 8 and 32 rows, prints whether the GEMM, captured behind a kernel that
writes its input late, read the new input (`gemm_waits`); and the same for a control, a torch elementwise
kernel, which never waits: it must print False, else the probe proves nothing.

    PYTHONPATH=. python3 bench/probe_cublas_chain.py
"""

from __future__ import annotations

import argparse
import json
import logging
from functools import partial

import torch
import torch.nn.functional as F

from srt.layers.cublas_chain import gemm_waits
from srt.layers.split_k import linear_partials


def transposed_weight(out_features: int, in_features: int) -> torch.Tensor:
    """An nn.Linear weight [out, in] stored as srt stores it: a view of a contiguous [in, out]."""
    return torch.randn(in_features, out_features, device="cuda", dtype=torch.bfloat16).t() * 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="Decode batch sizes to probe.")
    parser.add_argument("--json", help="Write the results here.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    hidden, heads_dim, kv_dim, intermediate = 2560, 2048, 512, 10240
    weights = {
        "qkv": transposed_weight(heads_dim + 2 * kv_dim, hidden),
        "q": transposed_weight(heads_dim, hidden),
        "o": transposed_weight(hidden, heads_dim),
        "gate_up": transposed_weight(2 * intermediate, hidden),
        "down": transposed_weight(hidden, intermediate),
    }
    gemms = {
        "qkv": partial(F.linear, weight=weights["qkv"]),
        "q": partial(F.linear, weight=weights["q"]),
        "o": partial(linear_partials, weight=weights["o"]),
        "gate_up": partial(F.linear, weight=weights["gate_up"]),
        "down": partial(linear_partials, weight=weights["down"]),
        "control: torch elementwise (must be False)": lambda x: x * 2,
    }
    results = []
    for rows in args.rows:
        for name, gemm in gemms.items():
            in_features = weights[name].shape[1] if name in weights else hidden
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            waits = gemm_waits(gemm, x)
            print(f"rows {rows:3d}  {name:45s} waits for the kernel ahead: {waits}", flush=True)
            results.append({"rows": rows, "gemm": name, "waits": waits})
    print(
        torch.cuda.get_device_name(), "torch", torch.__version__, "cuBLAS", torch.backends.cuda.preferred_blas_library()
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
