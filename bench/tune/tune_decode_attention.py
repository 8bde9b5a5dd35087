"""Sweep the launch parameters of the split-KV decode kernel at Gemma 4 decode shapes, on one GPU.

    PYTHONPATH=. python bench/tune/tune_decode_attention.py [--quick] [--json out.json]

Shapes: the first sliding and the first full attention layer of gemma-4-E4B-it and gemma-4-26B-A4B-it (heads,
KV heads, head_dim and window from srt's presets, i.e. gemma4_variants.json), bf16 queries over bf16 KV or, with
`--kv-cache-dtype fp8_e4m3`, FP8 KV (random values within e4m3's range, unit scales), batch 1, 8 and 32, one
decode row per request at the last of 512 or 4096 tokens of context, in pools laid out as the server's are.

For each shape every num_splits x block_n x num_warps x num_stages of the grid (plus the current default:
`num_kv_splits` and `default_decode_config`) runs `decode_attention` (split kernel + combine) once, its
output is compared with the default's (max abs diff), then it is timed as a CUDA-graph replay with L2 flushed
before each call (`timing.time_cuda`, median). Configs that do not compile or launch (shared memory,
registers) are recorded with their error and skipped. Per shape it prints the default's time, the best
config's (among those within REL_DIFF_TOL of the default) and the KV read rate: bytes of K and V the rows see
/ time. The host picks launch parameters from the batch size alone (never from sequence lengths, so decode
can run in CUDA graphs), so it also prints, per layer and batch size, the config whose worst slowdown against
each context's best is smallest: the one to adopt. All results go to --json, or to
$OUT/tune_decode_attention.json when $OUT is set.

Compiling ~750 kernel variants one after another takes longer than timing them, so --jobs worker processes
first compile every variant on a tiny batch with the same specialisation (strides, dtypes) into Triton's
on-disk cache; the timing process then loads them from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from itertools import product
from pathlib import Path

import torch
import triton
from tqdm import tqdm

from srt.configs.model_config import AttentionLayerSpec, ModelConfig
from srt.kernels.attention import decode as dk
from srt.kernels.kv_quant import is_fp8_kv
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.kv_pool import HybridKVPool, layer_kv_bytes
from srt.mem_cache.req_to_token_pool import ReqToTokenPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py and friends
from compile_pool import precompile  # noqa: E402
from timing import time_cuda, write_json  # noqa: E402

MODELS = ("gemma-4-E4B-it", "gemma-4-26B-A4B-it")
BATCH_SIZES = (1, 8, 32)
CONTEXTS = (512, 4096)
FULL_GRID = {"splits": (1, 2, 4, 8, 16, 32, 64), "block_n": (16, 32, 64), "warps": (2, 4, 8), "stages": (1, 2, 3)}
QUICK_GRID = {"splits": (1, 4, 16, 64), "block_n": (32, 64), "warps": (4, 8), "stages": (2, 3)}
# bf16 outputs of different split counts differ by an ulp or two (an ulp is 2^-8..2^-7 of the value);
# a max abs diff above this fraction of the largest output means a broken config
REL_DIFF_TOL = 3e-2
# the server's req_to_token is as wide as the context length; its row stride is part of the kernel's
# specialisation, so the compile workers' tiny batches must use the same width to hit the same cache entries
REQ_TO_TOKEN_COLUMNS = 131072
DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One launch choice: KV splits per row and the split kernel's block shape."""

    splits: int
    config: dk.DecodeConfig

    def sort_key(self) -> tuple[int, int, int, int]:
        return (self.splits, self.config.block_n, self.config.num_warps, self.config.num_stages)


@dataclasses.dataclass
class DecodeInputs:
    """Everything `decode_attention` reads for one layer and batch."""

    q: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    full_to_swa: torch.Tensor
    row_pool_indices: torch.Tensor
    row_seq_lens: torch.Tensor
    positions: torch.Tensor
    window: int | None
    kv_bytes: int  # K and V bytes the rows see, i.e. what the kernel must read from HBM

    def run(self, out: torch.Tensor, candidate: Candidate, partials: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        dk.decode_attention(
            self.q, out, self.k_buffer, self.v_buffer, self.req_to_token, self.full_to_swa, self.row_pool_indices,
            self.row_seq_lens, self.positions, self.window, candidate.splits, partials, candidate.config,
        )  # fmt: skip


def tuned_layers(models: Sequence[str]) -> list[tuple[str, AttentionLayerSpec]]:
    """(model, spec) of the first sliding and the first full layer of each model: its two decode shapes."""
    layers = []
    for model in models:
        specs = ModelConfig.from_preset(model).layers
        layers += [(model, next(s for s in specs if s.is_sliding == sliding)) for sliding in (True, False)]
    return layers


def build_inputs(
    spec: AttentionLayerSpec, batch_size: int, context: int, device: torch.device, kv_dtype: torch.dtype = DTYPE
) -> DecodeInputs:
    """Random KV (`kv_dtype`) for `context` tokens of each request in a one-layer pool; one bf16 query row per
    request."""
    spec = dataclasses.replace(spec, layer_id=0, kv_owner=0)  # the only layer of its pool
    total = batch_size * context
    allocator = SWATokenAllocator(total, total, device)
    pool = HybridKVPool([spec], allocator, kv_dtype, device)
    req_to_token = ReqToTokenPool(batch_size, REQ_TO_TOKEN_COLUMNS, device)
    rows = []
    for _ in range(batch_size):
        rows.append(req_to_token.alloc())
        req_to_token.write(rows[-1], 0, allocator.alloc(context))
    k_buffer, v_buffer = pool.kv_buffers(0)
    for buffer in (k_buffer, v_buffer):  # float8 tensors have no normal_: drawn in bf16, then cast
        buffer.copy_(torch.randn(buffer.shape, device=device, dtype=DTYPE).to(buffer.dtype))
    visible = min(context, spec.sliding_window or context)
    return DecodeInputs(
        q=torch.randn(batch_size, spec.num_heads, spec.head_dim, device=device, dtype=DTYPE),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token.req_to_token,
        full_to_swa=allocator.full_to_swa,
        row_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        row_seq_lens=torch.full((batch_size,), context, dtype=torch.int64, device=device),
        positions=torch.full((batch_size,), context - 1, dtype=torch.int64, device=device),
        window=spec.sliding_window,
        kv_bytes=batch_size * visible * layer_kv_bytes(spec, kv_dtype),
    )


def default_candidate(spec: AttentionLayerSpec, batch_size: int, num_sms: int, kv_dtype: torch.dtype) -> Candidate:
    """What the triton backend launches today for this layer, batch and KV dtype."""
    splits = dk.num_kv_splits(batch_size, spec.num_kv_heads, num_sms)
    return Candidate(splits, dk.default_decode_config(spec.head_dim, True, splits, is_fp8_kv(kv_dtype)))


def grid_candidates(grid: dict[str, tuple[int, ...]]) -> list[Candidate]:
    combos = product(grid["splits"], grid["block_n"], grid["warps"], grid["stages"])
    return [Candidate(s, dk.DecodeConfig(n, w, st)) for s, n, w, st in combos]


def _compile_worker(layer: tuple[AttentionLayerSpec, torch.dtype], candidates: list[Candidate]) -> int:
    """(Worker process) launch each candidate once on a tiny batch, so Triton compiles it into its disk cache.

    Returns how many failed; the timing process meets the same failures and records them."""
    spec, kv_dtype = layer
    device = torch.device("cuda")
    inputs = build_inputs(spec, batch_size=1, context=16, device=device, kv_dtype=kv_dtype)
    out = torch.empty_like(inputs.q)
    failed = 0
    for candidate in candidates:
        partials = dk.decode_partials(1, spec.num_heads, spec.head_dim, candidate.splits, device)
        try:
            inputs.run(out, candidate, partials)
        except Exception:  # out of shared memory / registers: reported by the timing process
            failed += 1
    torch.cuda.synchronize()
    return failed


def reference_output(inputs: DecodeInputs, candidate: Candidate) -> torch.Tensor:
    """The output of the current default, which every other config is compared with."""
    rows, heads, head_dim = inputs.q.shape
    out = torch.empty_like(inputs.q)
    inputs.run(out, candidate, dk.decode_partials(rows, heads, head_dim, candidate.splits, inputs.q.device))
    return out


def time_candidate(inputs: DecodeInputs, candidate: Candidate, reference: torch.Tensor, repeats: int) -> dict:
    """Max abs diff against `reference` and median device time of one call (split kernel + combine)."""
    record = {"splits": candidate.splits, **dataclasses.asdict(candidate.config)}
    rows, heads, head_dim = inputs.q.shape
    out = torch.full_like(inputs.q, float("nan"))
    partials = dk.decode_partials(rows, heads, head_dim, candidate.splits, inputs.q.device)
    call = lambda: inputs.run(out, candidate, partials)
    try:
        call()
        diff = float((out.float() - reference.float()).abs().max())
        seconds = time_cuda(call, warmup=5, repeats=repeats, use_graph=True, flush_l2=True)
    except Exception as exc:  # a block shape that does not fit the chip is a result too
        return {**record, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {**record, "us": seconds * 1e6, "GBps": inputs.kv_bytes / seconds / 1e9, "max_abs_diff": diff}


def sweep_shape(inputs: DecodeInputs, default: Candidate, candidates: list[Candidate], repeats: int, bar) -> dict:
    """Every candidate's record, the default's and the fastest one whose output agrees with the default's."""
    reference = reference_output(inputs, default)
    tolerance = REL_DIFF_TOL * float(reference.float().abs().max())
    records = []
    for candidate in candidates:
        records.append(time_candidate(inputs, candidate, reference, repeats))
        bar.update()
    timed = [r for r in records if "us" in r]
    agree = [r for r in timed if r["max_abs_diff"] <= tolerance]
    default_record = records[candidates.index(default)]
    return {
        "default": default_record,
        "best": min(agree, key=lambda r: r["us"]),
        "failed": len(records) - len(timed),
        "diff_tol": tolerance,
        "over_diff_tol": len(timed) - len(agree),
        "configs": records,
    }


def config_key(record: dict) -> tuple[int, int, int, int]:
    return (record["splits"], record["block_n"], record["num_warps"], record["num_stages"])


def pick_per_batch(results: list[dict]) -> list[dict]:
    """Per (model, layer, batch size): the config, among those that ran and agreed at every context, whose
    largest slowdown against that context's best is smallest, with the default's slowdown for comparison."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["layer"]["layer_type"], r["batch_size"]), []).append(r)
    picks = []
    for (model, layer_type, batch_size), shapes in groups.items():
        slowdowns: dict[tuple[int, int, int, int], list[float]] = {}
        for shape in shapes:
            for record in shape["configs"]:
                if "us" in record and record["max_abs_diff"] <= shape["diff_tol"]:
                    slowdowns.setdefault(config_key(record), []).append(record["us"] / shape["best"]["us"])
        everywhere = {key: max(ratios) for key, ratios in slowdowns.items() if len(ratios) == len(shapes)}
        key = min(everywhere, key=everywhere.get)
        default = max(shape["default"]["us"] / shape["best"]["us"] for shape in shapes)
        config = dict(zip(("splits", "block_n", "num_warps", "num_stages"), key))
        picks.append({
            "model": model, "layer_type": layer_type, "batch_size": batch_size,
            "contexts": [shape["context"] for shape in shapes], "config": config,
            "worst_slowdown": everywhere[key], "default": config_key(shapes[0]["default"]),
            "default_worst_slowdown": default,
        })  # fmt: skip
    return picks


def describe(record: dict) -> str:
    if "us" not in record:
        return f"s{record['splits']} n{record['block_n']} w{record['num_warps']} st{record['num_stages']} failed"
    return (
        f"s{record['splits']} n{record['block_n']} w{record['num_warps']} st{record['num_stages']} "
        f"{record['us']:6.1f} us {record['GBps']:5.0f} GB/s"
    )


def shape_name(model: str, spec: AttentionLayerSpec, batch_size: int, context: int) -> str:
    short, kind = model.removeprefix("gemma-4-").removesuffix("-it"), spec.layer_type.split("_")[0]
    return f"{short} {kind} d{spec.head_dim} {spec.num_heads}/{spec.num_kv_heads} bs{batch_size} ctx{context}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"Reduced grid: {QUICK_GRID}.")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="Presets whose layers to tune.")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=list(BATCH_SIZES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS), help="Tokens of KV per row.")
    parser.add_argument("--repeats", type=int, default=40, help="Timed calls per config (median).")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="Compile processes (0: compile inline).")
    parser.add_argument("--json", type=Path, help="Results file (default $OUT/tune_decode_attention.json).")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto", help="bf16 (auto) or FP8 KV.")
    args = parser.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else DTYPE
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode_attention needs a CUDA device")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    layers = tuned_layers(args.models)
    grid = grid_candidates(QUICK_GRID if args.quick else FULL_GRID)
    shapes = [(m, spec, b, c) for m, spec in layers for b in args.batch_sizes for c in args.contexts]
    candidates = {
        (m, spec, b): sorted({*grid, default_candidate(spec, b, sms, kv_dtype)}, key=Candidate.sort_key)
        for m, spec, b, _ in shapes
    }
    if args.jobs > 0:  # the kernels do not depend on batch or context: one compile per layer and candidate
        per_layer = {spec: set() for _, spec in layers}
        for (_, spec, _), cands in candidates.items():
            per_layer[spec].update(cands)
        work = [((spec, kv_dtype), sorted(cands, key=Candidate.sort_key)) for spec, cands in per_layer.items()]
        precompile(_compile_worker, work, args.jobs, chunk=6)

    torch.manual_seed(0)
    results = []
    bar = tqdm(total=sum(len(candidates[m, spec, b]) for m, spec, b, _ in shapes), desc="time", unit="cfg")
    for model, spec, batch_size, context in shapes:
        name = shape_name(model, spec, batch_size, context)
        bar.set_postfix_str(name)
        inputs = build_inputs(spec, batch_size, context, device, kv_dtype)
        default = default_candidate(spec, batch_size, sms, kv_dtype)
        sweep = sweep_shape(inputs, default, candidates[model, spec, batch_size], args.repeats, bar)
        default_us, best = sweep["default"]["us"], sweep["best"]
        bar.write(
            f"{name}: KV {inputs.kv_bytes / 1e6:.1f} MB | default {describe(sweep['default'])} | best "
            f"{describe(best)} ({default_us / best['us']:.2f}x, diff {best['max_abs_diff']:.1e}) | "
            f"{sweep['failed']} failed, {sweep['over_diff_tol']} over diff tol"
        )
        layer = {"model": model, "layer": dataclasses.asdict(spec), "batch_size": batch_size, "context": context}
        results.append({"shape": name, **layer, "kv_bytes": inputs.kv_bytes, **sweep})
        del inputs
        torch.cuda.empty_cache()
    bar.close()

    print(f"\n{'shape':44} {'default':>36} {'best':>36} {'speedup':>8}")
    for r in results:
        speedup = r["default"]["us"] / r["best"]["us"]
        print(f"{r['shape']:44} {describe(r['default']):>36} {describe(r['best']):>36} {speedup:7.2f}x")
    picks = pick_per_batch(results)
    print("\nper layer and batch size, over all contexts (worst slowdown against each context's best):")
    for p in picks:
        c = p["config"]
        chosen = f"s{c['splits']} n{c['block_n']} w{c['num_warps']} st{c['num_stages']}"
        default = "s{} n{} w{} st{}".format(*p["default"])
        short = p["model"].removeprefix("gemma-4-").removesuffix("-it")
        print(
            f"  {short} {p['layer_type'].split('_')[0]} bs{p['batch_size']}: {chosen} "
            f"({p['worst_slowdown']:.2f}x), default {default} ({p['default_worst_slowdown']:.2f}x)"
        )
    meta = {"device": props.name, "sms": sms, "torch": torch.__version__, "triton": triton.__version__}
    meta["kv_cache_dtype"] = args.kv_cache_dtype
    meta.update(rel_diff_tol=REL_DIFF_TOL, grid=QUICK_GRID if args.quick else FULL_GRID)
    write_json(args.json, "tune_decode_attention.json", {**meta, "per_batch": picks, "shapes": results})


if __name__ == "__main__":
    main()
