"""MoE of gemma-4-26B-A4B on one GPU: fused routing and fused experts against the torch paths (bf16).

    PYTHONPATH=. python bench/bench_moe.py [--tokens 1 32 512 8192] [--no-sweep] [--fp8] [--json out.json]

Shapes: hidden 2816, 128 experts, top 8, moe_intermediate 704. For each token count:

- routing of bf16 router logits [tokens, 128]: the fused Triton kernel against the torch reference
  (`topk_routing_reference`: stable sort for the tie rule) and transformers' ops (softmax, topk, renormalize,
  scale); ids must equal the reference's.
- experts: the torch loop (`Experts.forward_reference`, what the CPU path runs) against the fused backends
  ("triton", "grouped_mm"); relative error of each against the loop in float32 on the same bf16 weights.
  With sweep, other block shapes of the triton kernels too.
- with --fp8, the same experts quantized to FP8 (`Experts.quantize_fp8`: float8_e4m3fn weights, float32 scales
  per output channel) through the triton backend, side by side with bf16 in the same record ("fp8_triton"):
  error against the bf16 oracle (the quantization error) and against the dequantized FP8 loop (the kernels'
  own error), its floor (half the weight bytes), and its speedup over bf16 triton; with sweep, FP8_SWEEP too.
  The decode sizes and a prefill: `--fp8 --tokens 1 32 7000`.

Times are medians in microseconds (`timing.py`): `gpu_us` from CUDA events (L2 flushed before each call, so
the experts' weights come from HBM), `graph_us` a CUDA graph replay of one call (no launch gaps; not for the
torch loop, which reads expert ids back to the host), `host_us` wall time per call of 50 calls back to back
(what an eager decode step pays: launch overheads included). Floors: the touched experts'
weights over 3.0 TB/s (H100 copy bandwidth seen here), FLOPs over 790 TFLOP/s. Results go to --json, or to
$OUT/bench_moe.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from timing import time_cuda, time_host, write_json

from srt.kernels.moe.experts import ExpertsConfig, default_experts_config, w8a8_possible
from srt.kernels.moe.routing import topk_routing, topk_routing_reference
from srt.layers.moe import fused_experts as fe
from srt.layers.moe.experts import Experts

HIDDEN, EXPERTS, TOP_K, INTER = 2816, 128, 8, 704
HBM_BYTES_PER_S, BF16_FLOPS = 3.0e12, 790e12
DEVICE = "cuda"
SWEEP = [
    ExpertsConfig(16, 32, 64, 128, 4, 4),
    ExpertsConfig(16, 64, 128, 128, 4, 3),
    ExpertsConfig(16, 16, 32, 128, 4, 4),
    ExpertsConfig(32, 64, 64, 64, 4, 4),
    ExpertsConfig(64, 64, 128, 64, 4, 3),
    ExpertsConfig(128, 64, 128, 64, 8, 3),
    ExpertsConfig(128, 128, 128, 64, 8, 3),
]
# FP8 weight tiles are half the bytes: wider K (or N) tiles keep as many bytes in flight as the bf16 ones
FP8_SWEEP = [
    ExpertsConfig(16, 32, 64, 128, 4, 4),
    ExpertsConfig(16, 32, 64, 256, 4, 4),
    ExpertsConfig(16, 64, 128, 256, 4, 3),
    ExpertsConfig(16, 64, 64, 128, 4, 5),
    ExpertsConfig(32, 64, 64, 128, 4, 4),
    ExpertsConfig(64, 64, 128, 128, 4, 3),
    ExpertsConfig(128, 64, 256, 64, 8, 3),
    ExpertsConfig(128, 128, 128, 128, 8, 3),
    # swapped product: the upcast weight tile is the dot's first operand (wgmma from registers), BLOCK_N its M
    ExpertsConfig(16, 64, 64, 128, 4, 4, swap_ab=True),
    ExpertsConfig(128, 128, 256, 64, 8, 3, swap_ab=True),
    # W8A8: rows quantized per token (and per slot) first, FP8 MMAs; swapped at decode sizes (wgmma's M is then
    # the weight tile's BLOCK_N), unswapped with BLOCK_M >= 64 at prefill sizes
    ExpertsConfig(16, 32, 64, 128, 4, 4, w8a8=True),
    ExpertsConfig(16, 64, 64, 128, 4, 4, swap_ab=True, w8a8=True),
    ExpertsConfig(16, 128, 128, 128, 8, 3, swap_ab=True, w8a8=True),
    ExpertsConfig(64, 64, 128, 128, 4, 4, w8a8=True),
    ExpertsConfig(64, 128, 128, 128, 4, 4, w8a8=True),
    ExpertsConfig(128, 64, 128, 128, 4, 4, w8a8=True),
    ExpertsConfig(128, 64, 256, 128, 8, 3, w8a8=True),
    ExpertsConfig(128, 64, 256, 64, 8, 4, w8a8=True),
    ExpertsConfig(128, 128, 128, 128, 8, 3, w8a8=True),
    ExpertsConfig(128, 128, 256, 128, 8, 3, w8a8=True),
    ExpertsConfig(128, 128, 128, 64, 8, 4, w8a8=True),
    # 256-wide K-steps: the FP8 MMA's sums go to float32 every 256 products instead of 128
    ExpertsConfig(128, 64, 256, 256, 8, 2, w8a8=True),
    ExpertsConfig(128, 64, 128, 256, 8, 3, w8a8=True),
    ExpertsConfig(64, 64, 128, 256, 4, 3, w8a8=True),
    ExpertsConfig(128, 128, 128, 256, 8, 2, w8a8=True),
]

# weight-only FP8 blocks at decode sizes (a few slots per expert): the down GEMM's K is only 704 (2.75 steps of 256)
FP8_DECODE_SWEEP = [
    ExpertsConfig(16, 32, 64, 256, 4, 4),  # srt's
    ExpertsConfig(16, 32, 128, 256, 4, 4),
    ExpertsConfig(16, 32, 32, 256, 4, 4),
    ExpertsConfig(16, 32, 64, 128, 4, 4),
    ExpertsConfig(16, 32, 128, 128, 4, 4),
    ExpertsConfig(16, 32, 64, 256, 4, 2),
    ExpertsConfig(16, 32, 64, 256, 8, 4),
    ExpertsConfig(16, 64, 64, 256, 4, 4),
    ExpertsConfig(16, 32, 64, 512, 4, 2),
    ExpertsConfig(16, 32, 32, 512, 4, 2),
    ExpertsConfig(16, 32, 64, 256, 2, 4),
    # wider and deeper, for the float16 widening (one cvt per two weights, stop 48)
    ExpertsConfig(16, 64, 128, 256, 4, 4),
    ExpertsConfig(16, 64, 64, 128, 4, 6),
    ExpertsConfig(16, 32, 64, 128, 4, 8),
    ExpertsConfig(16, 128, 128, 128, 8, 4),
    # swapped: the float16 weight tile is wgmma's A operand, read from registers
    ExpertsConfig(16, 64, 64, 128, 4, 4, swap_ab=True),
    ExpertsConfig(16, 64, 64, 256, 4, 3, swap_ab=True),
    ExpertsConfig(16, 128, 128, 128, 4, 3, swap_ab=True),
]


def transformers_routing(logits: torch.Tensor, scales: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k=top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scales[ids], ids


def gpu_us(fn: Callable[[], object]) -> float:
    return 1e6 * time_cuda(fn, flush_l2=True)


def graph_us(fn: Callable[[], object]) -> float:
    return 1e6 * time_cuda(fn, use_graph=True, flush_l2=True)


def host_us(fn: Callable[[], object]) -> float:
    return 1e6 * time_host(fn, calls=50)


def timings(fn: Callable[[], object], graph: bool = True) -> dict[str, float | str]:
    result: dict[str, float | str] = {}
    for name, timer in (("gpu_us", gpu_us), ("graph_us", graph_us), ("host_us", host_us)):
        if name == "graph_us" and not graph:
            continue
        try:
            result[name] = round(timer(fn), 2)
        except Exception as error:  # noqa: BLE001 - record and go on: one failure must not lose the rest
            result[name] = f"error: {error!r}"[:300]
    return result


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


def bench_routing(tokens: int) -> dict:
    logits = torch.randn(tokens, EXPERTS, device=DEVICE).to(torch.bfloat16)
    scales = 0.5 + torch.rand(EXPERTS, device=DEVICE)
    weights, ids = topk_routing(logits, scales, TOP_K, use_triton=True)
    ref_weights, ref_ids = topk_routing_reference(logits, scales, TOP_K)
    record = {
        "part": "routing",
        "tokens": tokens,
        "ids_equal": bool(torch.equal(ids.long(), ref_ids)),
        "max_weight_diff": float((weights - ref_weights).abs().max()),
        "fused": timings(lambda: topk_routing(logits, scales, TOP_K, use_triton=True)),
        "torch_reference": timings(lambda: topk_routing_reference(logits, scales, TOP_K)),
        "transformers_ops": timings(lambda: transformers_routing(logits, scales, TOP_K)),
    }
    for name in ("torch_reference", "transformers_ops"):
        for key in ("gpu_us", "graph_us", "host_us"):
            theirs, ours = record[name].get(key), record["fused"].get(key)
            if isinstance(theirs, float) and isinstance(ours, float):
                record[f"speedup_vs_{name}_{key[:-3]}"] = round(theirs / ours, 2)
    return record


def bench_fp8_experts(
    record: dict,
    hidden: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    exact: torch.Tensor,
    fp8: Experts,
    sweep: bool | str,
) -> None:
    """The FP8 experts through triton, added to the bf16 `record` of the same inputs."""
    args = (hidden, fp8.gate_up_proj, fp8.down_proj, weights, ids)
    scales = {"gate_up_scale": fp8.gate_up_proj_scale, "down_scale": fp8.down_proj_scale}
    dequantized = fp8.forward_reference(hidden.float(), weights, ids.long())
    tokens = hidden.shape[0]
    try:
        out = fe.fused_experts(*args, "triton", **scales)
    except Exception as error:  # noqa: BLE001 - record and go on with the next size
        record["fp8_triton"] = {"error": f"{error!r}"[:300]}
        return
    record["fp8_triton"] = {
        "error": relative_error(out, exact),
        "error_vs_dequantized": relative_error(out, dequantized),
        **timings(lambda: fe.fused_experts(*args, "triton", **scales)),
        "config": list(
            default_experts_config(tokens * TOP_K, EXPERTS, True, True, w8a8_possible(*args[:2])).__dict__.values()
        ),
    }
    weight_bytes = record["experts_touched"] * 3 * HIDDEN * INTER  # one byte per weight
    flops = tokens * TOP_K * 3 * HIDDEN * INTER * 2
    record["fp8_floor_us"] = round(1e6 * max(weight_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS), 2)
    for key in ("gpu_us", "graph_us", "host_us"):
        theirs, ours = record["triton"].get(key), record["fp8_triton"].get(key)
        if isinstance(theirs, float) and isinstance(ours, float):
            record[f"fp8_speedup_vs_bf16_triton_{key[:-3]}"] = round(theirs / ours, 2)
    if not sweep:
        return
    record["fp8_triton_sweep"] = []
    for config in FP8_DECODE_SWEEP if sweep == "decode" else FP8_SWEEP:
        try:
            out = fe.triton_experts(*args, config=config, **scales)
            entry = {
                "error_vs_dequantized": relative_error(out, dequantized),
                "gpu_us": round(gpu_us(lambda c=config: fe.triton_experts(*args, config=c, **scales)), 2),
                "graph_us": round(graph_us(lambda c=config: fe.triton_experts(*args, config=c, **scales)), 2),
            }
        except Exception as error:  # noqa: BLE001
            entry = {"error": f"{error!r}"[:300]}
        record["fp8_triton_sweep"].append({"config": list(config.__dict__.values()), **entry})


def bench_experts(tokens: int, experts: Experts, sweep: bool | str, fp8: Experts | None = None) -> dict:
    """`sweep`: True sweeps SWEEP (bf16) and FP8_SWEEP, "decode" FP8_DECODE_SWEEP only, False nothing."""
    hidden = torch.randn(tokens, HIDDEN, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device=DEVICE)
    weights, ids = topk_routing(logits, experts.per_expert_scale, TOP_K, use_triton=True)
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * HIDDEN * INTER * 2
    flops = tokens * TOP_K * 3 * HIDDEN * INTER * 2
    with torch.no_grad():
        exact = experts.exact.forward_reference(hidden.float(), weights, ids.long())
        loop = experts.forward_reference(hidden, weights, ids.long())
        record = {
            "part": "experts",
            "tokens": tokens,
            "experts_touched": touched,
            "floor_us": round(1e6 * max(weight_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS), 2),
            "torch_loop": {
                "error": relative_error(loop, exact),
                **timings(lambda: experts.forward_reference(hidden, weights, ids.long()), graph=False),
            },
        }
        args = (hidden, experts.gate_up_proj, experts.down_proj, weights, ids)
        for backend in fe.BACKENDS:
            try:
                out = fe.fused_experts(*args, backend)
                record[backend] = {
                    "error": relative_error(out, exact),
                    **timings(lambda b=backend: fe.fused_experts(*args, b)),
                }
            except Exception as error:  # noqa: BLE001
                record[backend] = {"error": f"{error!r}"[:300]}
        default = default_experts_config(tokens * TOP_K, EXPERTS, True)
        record["triton"]["config"] = list(default.__dict__.values())
        if sweep is True:
            record["triton_sweep"] = []
            for config in SWEEP:
                if config == default:
                    continue
                try:
                    out = fe.triton_experts(*args, config=config)
                    entry = {
                        "error": relative_error(out, exact),
                        "gpu_us": round(gpu_us(lambda c=config: fe.triton_experts(*args, config=c)), 2),
                    }
                except Exception as error:  # noqa: BLE001
                    entry = {"error": f"{error!r}"[:300]}
                record["triton_sweep"].append({"config": list(config.__dict__.values()), **entry})
        if fp8 is not None:
            bench_fp8_experts(record, hidden, weights, ids, exact, fp8, sweep)
    for backend in fe.BACKENDS:
        for key in ("gpu_us", "host_us"):
            theirs, ours = record["torch_loop"].get(key), record[backend].get(key)
            if isinstance(theirs, float) and isinstance(ours, float):
                record[f"{backend}_speedup_{key[:-3]}"] = round(theirs / ours, 2)
    return record


def make_experts() -> Experts:
    experts = Experts(EXPERTS, HIDDEN, INTER)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, HIDDEN**-0.5)
        experts.down_proj.normal_(0, INTER**-0.5)
    experts.per_expert_scale = 0.5 + torch.rand(EXPERTS, device=DEVICE)
    bf16 = experts.to(DEVICE, torch.bfloat16)
    exact = Experts(EXPERTS, HIDDEN, INTER).to(DEVICE)  # float32 copy of the rounded weights: the oracle
    with torch.no_grad():
        exact.gate_up_proj.copy_(bf16.gate_up_proj)
        exact.down_proj.copy_(bf16.down_proj)
    bf16.exact = exact
    return bf16


def fp8_experts(bf16: Experts) -> Experts:
    """An FP8 copy of the bf16 experts (quantized on the GPU, as a load-time hook would)."""
    fp8 = Experts(EXPERTS, HIDDEN, INTER).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        fp8.gate_up_proj.copy_(bf16.gate_up_proj)
        fp8.down_proj.copy_(bf16.down_proj)
    fp8.quantize_fp8()
    return fp8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 8192])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="FP8 experts side by side with bf16 (triton)")
    parser.add_argument("--fp8-decode-sweep", action="store_true", help="With --fp8: sweep FP8_DECODE_SWEEP only.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    experts = make_experts()
    fp8 = fp8_experts(experts) if args.fp8 else None
    records = []
    for tokens in args.tokens:
        records.append(bench_routing(tokens))
        print(json.dumps(records[-1]), flush=True)
    for tokens in args.tokens:
        sweep = "decode" if args.fp8_decode_sweep else not args.no_sweep
        records.append(bench_experts(tokens, experts, sweep, fp8))
        print(json.dumps(records[-1]), flush=True)
    write_json(args.json, "bench_moe.json", {"device": torch.cuda.get_device_name(), "records": records})
    print("\nrouting: tokens | fused gpu/graph/host us | torch reference | transformers ops | ids equal")
    for r in records:
        if r["part"] == "routing":
            row = [r["fused"], r["torch_reference"], r["transformers_ops"]]
            cells = " | ".join("/".join(str(t.get(k)) for k in ("gpu_us", "graph_us", "host_us")) for t in row)
            print(f"{r['tokens']:6d} | {cells} | {r['ids_equal']}")
    print("\nexperts: tokens | floor us | loop gpu/host us | triton gpu/graph/host us, err | grouped_mm ..., err")
    for r in records:
        if r["part"] == "experts":
            cells = []
            for name in ("torch_loop", "triton", "grouped_mm"):
                t = r[name]
                times = "/".join(str(t.get(k)) for k in ("gpu_us", "graph_us", "host_us") if k in t)
                err = t.get("error")
                cells.append(f"{times}, {err:.1e}" if isinstance(err, float) else f"{times}, {err}")
            print(f"{r['tokens']:6d} | {r['floor_us']} | " + " | ".join(cells))
    if args.fp8:
        print(
            "\nFP8 experts: tokens | bf16 floor us | bf16 triton gpu/graph/host us | fp8 floor us | fp8 triton "
            "gpu/graph/host us | graph speedup | err vs bf16 oracle | err vs dequantized"
        )
        for r in records:
            if r["part"] == "experts":
                bf16, fp8_record = r["triton"], r["fp8_triton"]
                cells = ["/".join(str(t.get(k)) for k in ("gpu_us", "graph_us", "host_us")) for t in (bf16, fp8_record)]
                errors = [fp8_record.get(k) for k in ("error", "error_vs_dequantized")]
                errors = " | ".join(f"{e:.1e}" if isinstance(e, float) else str(e) for e in errors)
                print(
                    f"{r['tokens']:6d} | {r['floor_us']} | {cells[0]} | {r.get('fp8_floor_us')} | {cells[1]} | "
                    f"{r.get('fp8_speedup_vs_bf16_triton_graph')} | {errors}"
                )
                timed = [e for e in r.get("fp8_triton_sweep", []) if isinstance(e.get("graph_us"), float)]
                for entry in sorted(timed, key=lambda e: e["graph_us"]):  # fastest first
                    print(f"{'':6s}   {entry['graph_us']:9.2f} us  err vs dequantized "
                          f"{entry['error_vs_dequantized']:.1e}  {entry['config']}")  # fmt: skip


if __name__ == "__main__":
    main()
