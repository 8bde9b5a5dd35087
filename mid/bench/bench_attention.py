"""Triton attention backend vs the torch_native reference at Gemma 4 E4B shapes (bf16), on one GPU.

    PYTHONPATH=. python bench/bench_attention.py [--sweep] [--json out.json]

For each case (extend 1 x 7000 and 8 x 2048 new tokens; decode batch 1 and 32 at 512 and 4096 tokens of
context) and each layer type (sliding: head_dim 256, window 512; full: head_dim 512; 8 query / 2 KV heads):
max abs error of triton (bf16) and of torch_native (bf16) against torch_native on fp32 queries over the same
bf16 KV, and median times (CUDA events, L2 flushed before each call: `timing.time_cuda`) of both backends'
`forward` without the KV write; decode also as a CUDA graph replay (what the decode loop runs). `--sweep` times
other block shapes of the kernels. Results go to --json, or to $OUT/bench_attention.json when $OUT is set.

`--chain` times decode only, as the step runs it: one CUDA graph of CHAIN_LAYERS back-to-back calls per layer
type, each over its own layer's KV (more bytes than L2 holds), so chained kernels overlap their neighbours and
nothing is flushed between calls; it prints microseconds per call and the KV bandwidth. With `--sweep` it also
times the decode kernel's other split counts and block shapes (CHAIN_SWEEP) that way, each with its largest
difference from the backend's own output; `--cases TEXT` keeps the decode cases whose name holds TEXT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import triton
from timing import print_kernel_resources, time_cuda, write_json

from srt.configs.model_config import FULL, SLIDING, AttentionLayerSpec
from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.kernels.attention import decode as dk
from srt.kernels.attention import extend as ek
from srt.layers.attention import create_attention_backend
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool

HEADS, KV_HEADS, WINDOW = 8, 2, 512  # gemma-4-E4B
LAYERS = (
    AttentionLayerSpec(0, SLIDING, 256, HEADS, KV_HEADS, False, 0, WINDOW),
    AttentionLayerSpec(1, FULL, 512, HEADS, KV_HEADS, False, 1, None),
)
# (name, mode, [(cached tokens, new tokens)] per request)
CASES = [
    ("extend 1x7000", ForwardMode.EXTEND, [(0, 7000)]),
    ("extend 8x2048", ForwardMode.EXTEND, [(0, 2048)] * 8),
    ("decode bs1 ctx512", ForwardMode.DECODE, [(511, 1)]),
    ("decode bs1 ctx4096", ForwardMode.DECODE, [(4095, 1)]),
    ("decode bs32 ctx512", ForwardMode.DECODE, [(511, 1)] * 32),
    ("decode bs32 ctx4096", ForwardMode.DECODE, [(4095, 1)] * 32),
]
EXTEND_SWEEP = {
    256: [
        ek.ExtendConfig(32, 4, 64, 8, 1, value_splits=2),
        ek.ExtendConfig(32, 4, 64, 8, 3, value_splits=2),
        ek.ExtendConfig(16, 4, 64, 8, 3, value_splits=1),
        ek.ExtendConfig(32, 4, 32, 8, 3, value_splits=2),
    ],
    512: [
        ek.ExtendConfig(32, 4, 32, 8, 1, value_splits=2),
        ek.ExtendConfig(32, 4, 32, 8, 3, value_splits=2),
        ek.ExtendConfig(16, 4, 32, 8, 3, value_splits=2),
        ek.ExtendConfig(32, 4, 16, 8, 3, value_splits=2),
    ],
}
DECODE_SWEEP = {
    256: [dk.DecodeConfig(32, 4, 2), dk.DecodeConfig(64, 4, 3), dk.DecodeConfig(16, 4, 4)],
    512: [dk.DecodeConfig(32, 4, 2), dk.DecodeConfig(64, 4, 3), dk.DecodeConfig(16, 4, 4)],
}


CHAIN_LAYERS = 8
CHAIN_SWEEP = [  # (block_n, num_warps, num_stages) x split counts
    (dk.DecodeConfig(*config), splits)
    for config in (
        (32, 4, 1), (32, 4, 2), (32, 4, 3), (64, 4, 1), (64, 8, 1), (64, 4, 2), (64, 4, 3), (16, 2, 3), (64, 2, 3),
        (32, 8, 1),
    )
    for splits in (1, 2, 4, 8, 16)  # 1: no combine kernel
]  # fmt: skip


def build_batch(
    mode: ForwardMode, requests: list[tuple[int, int]], layers: tuple[AttentionLayerSpec, ...] = LAYERS
) -> ForwardBatch:
    """Pools holding random bf16 KV for every token of every request, and the batch of their new tokens."""
    device = torch.device("cuda")
    total = sum(c + n for c, n in requests)
    allocator = SWATokenAllocator(total, total, device)
    pool = HybridKVPool(layers, allocator, torch.bfloat16, device)
    req_to_token = ReqToTokenPool(len(requests), max(c + n for c, n in requests) + 1, device)
    rows, new_slots = [], []
    for cached, new in requests:
        row = req_to_token.alloc()
        slots = allocator.alloc(cached + new)
        req_to_token.write(row, 0, slots)
        rows.append(row)
        new_slots.append(slots[cached:])
    for spec in layers:
        k, v = pool.kv_buffers(spec.layer_id)
        k.normal_()
        v.normal_()
    return ForwardBatch.build(
        mode=mode,
        new_token_ids=[[1] * n for _, n in requests],
        prefix_lens=[c for c, _ in requests],
        req_pool_indices=rows,
        out_cache_loc=torch.cat(new_slots),
        logits_rows=[],
        req_to_token_pool=req_to_token,
        kv_pool=pool,
    )


def visible_pairs(requests: list[tuple[int, int]], window: int | None) -> int:
    """(query, key) pairs that attention computes, for FLOP and byte counts."""
    pairs = 0
    for cached, new in requests:
        for pos in range(cached, cached + new):
            pairs += pos + 1 if window is None else min(pos + 1, window)
    return pairs


def kv_tokens_read(requests: list[tuple[int, int]], window: int | None) -> int:
    return sum(min(c + n, window) if window else c + n for c, n in requests)


def with_metadata(backend, batch: ForwardBatch) -> ForwardBatch:
    batch = dataclasses.replace(batch)
    backend.init_forward_metadata(batch)
    return batch


def time_ms(fn, warmup: int = 10, repeats: int = 100, use_graph: bool = False) -> float:
    """Median device milliseconds of `fn` (a CUDA graph replay of it with `use_graph`: fails on any host sync)."""
    return 1e3 * time_cuda(fn, warmup=warmup, repeats=repeats, use_graph=use_graph, flush_l2=True)


def run_case(name: str, mode: ForwardMode, requests: list[tuple[int, int]], sweep: bool) -> list[dict]:
    batch = build_batch(mode, requests)
    reference, triton_backend = create_attention_backend("torch_native"), create_attention_backend("triton")
    ref_batch, tri_batch = with_metadata(reference, batch), with_metadata(triton_backend, batch)
    results = []
    for spec in LAYERS:
        q = torch.randn(batch.num_tokens, HEADS, spec.head_dim, device="cuda", dtype=torch.bfloat16)
        exact = reference.forward(q.float(), None, None, spec, ref_batch, save_kv=False)
        ref_bf16 = reference.forward(q, None, None, spec, ref_batch, save_kv=False)
        ours = triton_backend.forward(q, None, None, spec, tri_batch, save_kv=False)
        torch.cuda.synchronize()
        record = {
            "case": name,
            "layer": f"{spec.layer_type} d{spec.head_dim}",
            "triton_max_abs_err": float((ours.float() - exact).abs().max()),
            "torch_native_bf16_max_abs_err": float((ref_bf16.float() - exact).abs().max()),
            "triton_ms": time_ms(
                lambda spec=spec, q=q: triton_backend.forward(q, None, None, spec, tri_batch, save_kv=False)
            ),
            "torch_native_ms": time_ms(
                lambda spec=spec, q=q: reference.forward(q, None, None, spec, ref_batch, save_kv=False),
                warmup=2,
                repeats=10,
            ),
        }
        if mode.is_decode():
            record["triton_graph_ms"] = time_ms(
                lambda spec=spec, q=q: triton_backend.forward(q, None, None, spec, tri_batch, save_kv=False),
                use_graph=True,
            )
            kv_bytes = kv_tokens_read(requests, spec.sliding_window) * KV_HEADS * spec.head_dim * 2 * 2
            record["triton_graph_GBps"] = kv_bytes / record["triton_graph_ms"] / 1e6
        else:
            flops = 4 * visible_pairs(requests, spec.sliding_window) * HEADS * spec.head_dim
            record["triton_TFLOPs"] = flops / record["triton_ms"] / 1e9
        if sweep:
            record["sweep"] = sweep_configs(spec, q, tri_batch, exact)
        results.append(record)
        print(json.dumps(record), flush=True)
    return results


def sweep_configs(spec: AttentionLayerSpec, q: torch.Tensor, batch: ForwardBatch, exact: torch.Tensor) -> list:
    """Times (and errors) of other block shapes for this layer and batch."""
    pool = batch.kv_pool
    k_buffer, v_buffer = pool.kv_buffers(spec.layer_id)
    req_to_token, full_to_swa = batch.req_to_token_pool.req_to_token, pool.allocator.full_to_swa
    meta = batch.attn_metadata
    out = torch.empty_like(q)
    rows = []
    if not meta.use_decode_kernel:
        for config in EXTEND_SWEEP[spec.head_dim]:
            tiles = ek.build_extend_tiles(meta.extend_seq_lens, q.shape[0], config.block_q)

            def call(config=config, tiles=tiles):
                ek.extend_attention(
                    q, out, k_buffer, v_buffer, req_to_token, full_to_swa, tiles, meta.req_pool_indices,
                    meta.seq_lens, meta.positions, spec.sliding_window, config,
                )  # fmt: skip

            rows.append(_time_variant(str(config), call, out, exact))
        return rows
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = dk.num_kv_splits(q.shape[0], KV_HEADS, sms)
    default = dk.default_decode_config(spec.head_dim, True)
    variants = [(default, splits) for splits in sorted({max(base // 4, 1), base * 2}) if splits <= dk.MAX_KV_SPLITS * 2]
    variants += [(config, base) for config in DECODE_SWEEP[spec.head_dim]]
    for config, splits in variants:
        partials = dk.decode_partials(q.shape[0], HEADS, spec.head_dim, splits, q.device)

        def call(config=config, splits=splits, partials=partials):
            dk.decode_attention(
                q, out, k_buffer, v_buffer, req_to_token, full_to_swa, meta.row_pool_indices,
                meta.row_seq_lens, meta.positions, spec.sliding_window, splits, partials, config,
            )  # fmt: skip

        rows.append(_time_variant(f"{config} splits={splits}", call, out, exact))
    return rows


def run_chain(name: str, requests: list[tuple[int, int]], sweep: bool) -> list[dict]:
    """Per-call time of CHAIN_LAYERS chained decode calls of each layer type, each over its own KV."""
    layers = tuple(
        dataclasses.replace(spec, layer_id=index, kv_owner=index)
        for index, spec in enumerate(spec for spec in LAYERS for _ in range(CHAIN_LAYERS))
    )
    batch = build_batch(ForwardMode.DECODE, requests, layers)
    backend = create_attention_backend("triton")
    batch = with_metadata(backend, batch)
    results = []
    for base in LAYERS:
        chain = [spec for spec in layers if spec.layer_type == base.layer_type]
        q = torch.randn(batch.num_tokens, HEADS, base.head_dim, device="cuda", dtype=torch.bfloat16)

        def calls(chain=chain, q=q) -> None:
            for spec in chain:
                backend.forward(q, None, None, spec, batch, save_kv=False)

        us = 1e6 * time_cuda(calls, warmup=5, repeats=50, use_graph=True) / len(chain)
        kv_bytes = kv_tokens_read(requests, base.sliding_window) * KV_HEADS * base.head_dim * 2 * 2
        record = {"case": f"chain {name}", "layer": f"{base.layer_type} d{base.head_dim}", "us_per_call": us,
                  "GBps": kv_bytes / us / 1e3}  # fmt: skip
        print(f"chain {name:20} {record['layer']:22} {us:8.2f} us/call {record['GBps']:8.0f} GB/s", flush=True)
        if sweep:
            expected = backend.forward(q, None, None, chain[-1], batch, save_kv=False)
            record["sweep"] = sweep_chain(chain, q, batch, expected)
        results.append(record)
    return results


def sweep_chain(
    chain: list[AttentionLayerSpec], q: torch.Tensor, batch: ForwardBatch, expected: torch.Tensor
) -> list[dict]:
    """Microseconds per call of the chain with each (config, splits) of CHAIN_SWEEP, fastest first, and the
    largest difference of its last call's output from `expected` (the backend's output for that layer)."""
    meta, pool = batch.attn_metadata, batch.kv_pool
    req_to_token, full_to_swa = batch.req_to_token_pool.req_to_token, pool.allocator.full_to_swa
    out = torch.empty_like(q)
    rows = []
    for config, splits in CHAIN_SWEEP:
        partials = dk.decode_partials(q.shape[0], HEADS, q.shape[2], splits, q.device)

        def calls(config=config, splits=splits, partials=partials) -> None:
            for spec in chain:
                k_buffer, v_buffer = pool.kv_buffers(spec.layer_id)
                dk.decode_attention(
                    q, out, k_buffer, v_buffer, req_to_token, full_to_swa, meta.row_pool_indices,
                    meta.row_seq_lens, meta.positions, spec.sliding_window, splits, partials, config,
                )  # fmt: skip

        try:
            out.fill_(float("nan"))
            calls()
            diff = float((out.float() - expected.float()).abs().max())
            us = 1e6 * time_cuda(calls, warmup=3, repeats=30, use_graph=True) / len(chain)
        except Exception as exc:  # a block shape that does not fit the chip is a result too
            rows.append({"config": str(config), "splits": splits, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append({"config": str(config), "splits": splits, "us_per_call": us, "max_abs_diff": diff})
    rows.sort(key=lambda r: r.get("us_per_call", float("inf")))
    for r in rows[:6]:
        print(
            f"    {r['config']} splits={r['splits']}: {r.get('us_per_call', float('nan')):.2f} us/call, "
            f"max abs diff vs the backend {r.get('max_abs_diff', float('nan')):.1e}",
            flush=True,
        )
    return rows


def _time_variant(label: str, call, out: torch.Tensor, exact: torch.Tensor) -> dict:
    try:
        out.fill_(float("nan"))
        call()
        error = float((out.float() - exact).abs().max())
        ms = time_ms(call, warmup=5, repeats=50)
    except Exception as exc:  # a block shape that does not fit the chip (shared memory) is a result too
        return {"config": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(f"    {label}: {ms:.4f} ms, max abs err {error:.2e}", flush=True)
    return {"config": label, "ms": ms, "max_abs_err": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="Also time other block shapes of the kernels.")
    parser.add_argument("--chain", action="store_true", help="Only decode, as chained calls over distinct layers.")
    parser.add_argument("--cases", default="", help="With --chain: only the cases whose name holds this text.")
    parser.add_argument("--json", type=Path, help="Where to write the results (default $OUT/bench_attention.json).")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    if args.chain:
        cases = [(name, requests) for name, mode, requests in CASES if mode.is_decode() and args.cases in name]
        results = [r for name, requests in cases for r in run_chain(name, requests, args.sweep)]
        print_kernel_resources(*dk.KERNELS)
        return write_results(args.json, props, results)
    results = []
    for name, mode, requests in CASES:
        print(f"== {name}", flush=True)
        results += run_case(name, mode, requests, args.sweep)
        torch.cuda.empty_cache()

    header = f"{'case':22} {'layer':22} {'triton ms':>10} {'graph ms':>9} {'native ms':>10} {'speedup':>8} "
    print("\n" + header + f"{'err triton':>11} {'err native':>11} {'rate':>14}")
    for r in results:
        graph = r.get("triton_graph_ms")
        best = graph if graph is not None else r["triton_ms"]
        rate = f"{r['triton_graph_GBps']:.0f} GB/s" if graph is not None else f"{r['triton_TFLOPs']:.0f} TFLOP/s"
        print(
            f"{r['case']:22} {r['layer']:22} {r['triton_ms']:10.4f} {graph or float('nan'):9.4f} "
            f"{r['torch_native_ms']:10.3f} {r['torch_native_ms'] / best:7.1f}x "
            f"{r['triton_max_abs_err']:11.2e} {r['torch_native_bf16_max_abs_err']:11.2e} {rate:>14}"
        )
    write_results(args.json, props, results)


def write_results(path: Path | None, props, results: list[dict]) -> None:
    payload = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__, "results": results}
    write_json(path, "bench_attention.json", payload)


if __name__ == "__main__":
    main()
