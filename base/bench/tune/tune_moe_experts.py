"""Block shapes of the triton fused experts at prefill sizes (gemma-4-26B-A4B, bf16, one GPU).

    PYTHONPATH=. python bench/tune/tune_moe_experts.py [--tokens 2048 7000] [--json out.json]

For each token count, times `triton_experts` (sort + align, gate/up GEMM with gelu gating, down GEMM,
combine) for the current default config and the candidates below, with uniform random routing; each
candidate's output must match the default's. Medians from CUDA events with L2 flushed (`timing.py`). A
candidate that does not compile or fit in shared memory is reported and skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from srt.kernels.moe.experts import ExpertsConfig, default_experts_config
from srt.layers.moe import fused_experts as fe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py and friends
from bench_moe import BF16_FLOPS, EXPERTS, HIDDEN, INTER, TOP_K  # noqa: E402
from timing import time_cuda, write_json  # noqa: E402

# (block_m, block_n_gate_up, block_n_down, block_k, num_warps, num_stages)
CANDIDATES = [
    (64, 64, 128, 64, 4, 4),
    (64, 128, 128, 64, 4, 4),
    (64, 128, 128, 64, 8, 3),
    (128, 64, 128, 64, 4, 4),
    (128, 64, 128, 64, 8, 4),
    (128, 128, 128, 64, 8, 3),
    (128, 128, 128, 64, 8, 4),
    (128, 128, 256, 64, 8, 3),
    (128, 64, 256, 64, 8, 3),
    (128, 128, 128, 32, 8, 4),
    (256, 64, 128, 64, 8, 3),
]


def time_configs(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> list[dict]:
    """One record per config at `tokens` tokens (uniform random routing)."""
    hidden = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, TOP_K, device="cuda")
    default = default_experts_config(tokens * TOP_K, EXPERTS, True)
    expected = fe.triton_experts(hidden, gate_up, down, weights, ids, default)
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    configs = [default] + [ExpertsConfig(*c) for c in CANDIDATES if ExpertsConfig(*c) != default]
    records = []
    for config in tqdm(configs, desc=f"{tokens} tokens"):
        record = {"tokens": tokens, "config": list(config.__dict__.values()), "default": config == default}
        try:
            out = fe.triton_experts(hidden, gate_up, down, weights, ids, config)
            diff = float((out.float() - expected.float()).abs().max())
            seconds = time_cuda(
                lambda config=config: fe.triton_experts(hidden, gate_up, down, weights, ids, config),
                warmup=3,
                repeats=20,
                flush_l2=True,
            )
            record |= {"us": seconds * 1e6, "max_diff": diff, "tflops": flops / seconds / 1e12}
        except Exception as error:  # noqa: BLE001 - a config that does not fit is skipped, not fatal
            record["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        records.append(record)
    timed = [r for r in records if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    base = next(r for r in timed if r["default"])
    print(
        f"{tokens} tokens: default {base['config']} {base['us']:.0f} us; best {best['config']} {best['us']:.0f} us "
        f"({base['us'] / best['us']:.2f}x, {best['tflops']:.0f} TFLOP/s; floor {flops / BF16_FLOPS * 1e6:.0f} us)"
    )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 7000], help="Token counts to time.")
    parser.add_argument("--json", type=Path, help="Write the results here (default: $OUT/tune_moe_experts.json).")
    args = parser.parse_args()
    torch.manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") * INTER**-0.5).bfloat16()
    records = [record for tokens in args.tokens for record in time_configs(tokens, gate_up, down)]
    write_json(args.json, "tune_moe_experts.json", {"device": torch.cuda.get_device_name(), "records": records})


if __name__ == "__main__":
    main()
