"""The per-layer-input (PLE) block at decode: torch's ops vs the split-K Triton kernels, bf16, on one GPU.

    PYTHONPATH=. python bench/tune/tune_ple.py [--rows 1 8 32] [--json out.json]

For E4B (hidden 2560) and E2B (hidden 1536), ple_dim 256, and each row count: a CUDA graph of LAYERS
back-to-back PLE blocks, one per layer with its own weights (so that, as in a decode step, the weights come
from HBM and not from L2), is timed by CUDA events after warm-up (`timing.time_cuda`); the table gives
microseconds per block. The torch path is what the decoder layer ran before these kernels (F.linear,
`gelu_tanh_mul`, F.linear); the Triton path is `per_layer_input_projection`. Both must agree (max error
relative to the largest output, share of bit-equal outputs). Results go to --json, or to $OUT/bench_ple.json
when $OUT is set. `--sweep` also times the Triton path with every tile choice of SWEEP (in place of
`choose_tiles`' answer) and prints the fastest.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from srt.kernels.gelu_mul import gelu_tanh_mul
from srt.kernels.per_layer_projection import ProjectionTiles, per_layer_input_projection

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py and friends
from timing import time_cuda, write_json  # noqa: E402

MODELS = {"E4B": 2560, "E2B": 1536}  # hidden size; ple_dim is 256 in both
PLE_DIM = 256
LAYERS = 42  # E4B's layer count: one graph is one decode step's worth of PLE blocks
SWEEP = [  # gate_block_p, gate_block_k, splits, project_block_n
    ProjectionTiles(*tiles) for tiles in itertools.product((16, 32, 64), (128, 256), (1, 2, 5, 10), (32, 64, 128))
]


class Weights:
    """LAYERS layers of PLE weights and one decode step's inputs, bf16 on the GPU."""

    def __init__(self, hidden_size: int, rows: int) -> None:
        bf16, device = torch.bfloat16, torch.device("cuda")
        self.gate = [
            torch.randn(PLE_DIM, hidden_size, device=device, dtype=bf16) / hidden_size**0.5 for _ in range(LAYERS)
        ]
        self.projection = [
            torch.randn(hidden_size, PLE_DIM, device=device, dtype=bf16) / PLE_DIM**0.5 for _ in range(LAYERS)
        ]
        self.hidden = 3 * torch.randn(rows, hidden_size, device=device, dtype=bf16)
        self.per_layer = torch.randn(rows, LAYERS, PLE_DIM, device=device, dtype=bf16)

    def torch_block(self, layer: int) -> torch.Tensor:
        gate = F.linear(self.hidden, self.gate[layer])
        return F.linear(gelu_tanh_mul(gate, self.per_layer[:, layer]), self.projection[layer])

    def triton_block(self, layer: int, tiles: ProjectionTiles | None = None) -> torch.Tensor:
        return per_layer_input_projection(
            self.hidden,
            self.per_layer[:, layer],
            self.gate[layer],
            self.projection[layer],
            use_triton=True,
            tiles=tiles,
        )

    def bytes_per_block(self) -> int:
        """Weights plus activations one block must read and write: the floor of its HBM traffic."""
        rows, hidden_size = self.hidden.shape
        return 2 * (2 * hidden_size * PLE_DIM + rows * (2 * hidden_size + PLE_DIM))


def run_case(model: str, rows: int) -> dict:
    weights = Weights(MODELS[model], rows)
    torch_outs = [weights.torch_block(i) for i in range(LAYERS)]
    triton_outs = [weights.triton_block(i) for i in range(LAYERS)]
    expected, got = torch.stack(torch_outs).float(), torch.stack(triton_outs).float()
    rel_err = float((got - expected).abs().max() / expected.abs().max())
    step = {name: (lambda fn=fn: [fn(i) for i in range(LAYERS)]) for name, fn in
            (("torch", weights.torch_block), ("triton", weights.triton_block))}  # fmt: skip
    torch_us = 1e6 * time_cuda(step["torch"], warmup=20, repeats=200, use_graph=True) / LAYERS
    triton_us = 1e6 * time_cuda(step["triton"], warmup=20, repeats=200, use_graph=True) / LAYERS
    return {
        "model": model,
        "hidden_size": MODELS[model],
        "ple_dim": PLE_DIM,
        "rows": rows,
        "torch_us": round(torch_us, 2),
        "triton_us": round(triton_us, 2),
        "speedup": round(torch_us / triton_us, 2),
        "triton_gb_per_s": round(weights.bytes_per_block() / triton_us / 1e3, 1),
        "max_rel_err": rel_err,
        "bit_equal": round(float((got == expected).float().mean()), 4),
    }


def sweep_tiles(model: str, rows: int) -> list[dict]:
    """Microseconds per block of the Triton path with each tile choice of SWEEP, fastest first."""
    weights = Weights(MODELS[model], rows)
    expected = torch.stack([weights.torch_block(i) for i in range(LAYERS)]).float()
    results = []
    for tiles in SWEEP:
        got = torch.stack([weights.triton_block(i, tiles) for i in range(LAYERS)]).float()
        step = lambda tiles=tiles: [weights.triton_block(i, tiles) for i in range(LAYERS)]  # noqa: E731
        us = 1e6 * time_cuda(step, warmup=10, repeats=100, use_graph=True) / LAYERS
        rel_err = float((got - expected).abs().max() / expected.abs().max())
        results.append({"model": model, "rows": rows, "tiles": tiles._asdict(), "triton_us": round(us, 2),
                        "max_rel_err": rel_err})  # fmt: skip
    results.sort(key=lambda r: r["triton_us"])
    for r in results[:5]:
        print(f"  sweep {model} rows {rows}: {r['triton_us']:6.2f} us  {r['tiles']}  rel err {r['max_rel_err']:.1e}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--sweep", action="store_true", help="also time every tile choice of SWEEP")
    parser.add_argument("--json", type=Path, help="write the results here (default: $OUT/bench_ple.json if set)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ple.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: {LAYERS} PLE blocks per CUDA graph, bf16, us per block")
    columns = ("model", 5), ("rows", 4), ("torch us", 9), ("triton us", 9), ("speedup", 7), ("GB/s", 7), ("rel err", 8)
    print(" ".join(f"{name:>{width}}" for name, width in (*columns, ("equal", 6))))
    results = []
    for model in args.models:
        for rows in args.rows:
            r = run_case(model, rows)
            results.append(r)
            print(
                f"{model:>5} {rows:>4} {r['torch_us']:>9.2f} {r['triton_us']:>9.2f} {r['speedup']:>7.2f} "
                f"{r['triton_gb_per_s']:>7.1f} {r['max_rel_err']:>8.1e} {r['bit_equal']:>6.3f}",
                flush=True,
            )
            if args.sweep:
                results += sweep_tiles(model, rows)
    write_json(args.json, "bench_ple.json", {"device": torch.cuda.get_device_name(), "results": results}, indent=2)


if __name__ == "__main__":
    main()
