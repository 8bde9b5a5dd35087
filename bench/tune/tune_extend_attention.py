"""Sweep the block shape of the extend (prefill) attention kernel at Gemma 4 prefill shapes, on one GPU.

    PYTHONPATH=. python bench/tune/tune_extend_attention.py [--tokens 8192] [--models ...] [--json out.json] \\
        [--kinds sliding full] [--block-m 64 128] [--value-splits 1 2 4] [--kv-cache-dtype fp8_e4m3]

Shapes: the first sliding and the first full attention layer of each model (heads, KV heads, head_dim and
window from srt's presets), bf16 (FP8 K/V with --kv-cache-dtype fp8_e4m3, scales 1), one prompt of --tokens
tokens prefilled whole (no cached prefix), its K/V in a one-layer pool laid out as the server's is. For each
shape every block_m x heads_per_prog x block_n x num_warps x num_stages x value_splits of the grid (plus the
current default, `default_extend_config`) runs `extend_attention` once, its output is compared with the
default's (max abs diff), then it is timed as a CUDA-graph replay (`timing.time_cuda`, median). Configs that do
not compile or launch (shared memory, registers) are recorded with their error and skipped. Per shape it prints
the default's time, the best config's and their rate in TFLOP/s of the attention the rows need (QK and PV over
the visible positions, 2 FLOPs a multiply-add; recomputed scores of value_splits > 1 not counted). All results
go to --json, or to $OUT/tune_extend_attention.json when $OUT is set.

Compiling the variants takes longer than timing them: --jobs worker processes first compile every variant
on a tiny prompt with the same specialisation into Triton's on-disk cache.
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
from srt.kernels.attention.extend import ExtendConfig, build_extend_tiles, default_extend_config, extend_attention
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: timing.py and friends
from compile_pool import precompile  # noqa: E402
from timing import time_cuda, write_json  # noqa: E402

MODELS = ("gemma-4-E4B-it", "gemma-4-26B-A4B-it", "gemma-4-31B-it")
GRID = {
    "block_m": (64, 128),  # query rows x heads per program (the MMA's M)
    "block_n": (32, 64, 128),
    "warps": (4, 8),
    "stages": (2, 3),
    "value_splits": (1, 2, 4),
}
# a broken config differs by far more than bf16 rounding of the default's output
REL_DIFF_TOL = 3e-2
REQ_TO_TOKEN_COLUMNS = 131072  # the server's row width: the row stride is part of the kernel's specialisation
DTYPE = torch.bfloat16


@dataclasses.dataclass
class ExtendInputs:
    """Everything `extend_attention` reads for one layer and one prompt prefilled whole."""

    q: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    full_to_swa: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    positions: torch.Tensor
    window: int | None
    flops: float  # QK and PV over the positions each row sees

    def default_config(self) -> ExtendConfig:
        """What the triton backend launches for this layer and KV dtype."""
        _, num_heads, head_dim = self.q.shape
        group = num_heads // self.k_buffer.shape[1]
        return default_extend_config(head_dim, group, on_gpu=True, element_size=self.k_buffer.element_size())

    def run(self, out: torch.Tensor, config: ExtendConfig, tiles: torch.Tensor) -> None:
        extend_attention(
            self.q, out, self.k_buffer, self.v_buffer, self.req_to_token, self.full_to_swa, tiles,
            self.req_pool_indices, self.seq_lens, self.positions, self.window, config,
        )  # fmt: skip

    def tiles(self, config: ExtendConfig) -> torch.Tensor:
        return build_extend_tiles(self.extend_seq_lens, self.q.shape[0], config.block_q)


def tuned_layers(
    models: Sequence[str], kinds: Sequence[str] = ("sliding", "full")
) -> list[tuple[str, AttentionLayerSpec]]:
    """(model, spec) of the first sliding and/or the first full layer of each model."""
    layers = []
    for model in models:
        specs = ModelConfig.from_preset(model).layers
        layers += [(model, next(s for s in specs if s.is_sliding == (kind == "sliding"))) for kind in kinds]
    return layers


def build_inputs(
    spec: AttentionLayerSpec, tokens: int, device: torch.device, kv_dtype: torch.dtype = DTYPE
) -> ExtendInputs:
    """Random bf16 q and K/V (`kv_dtype`) of one `tokens`-token prompt in a one-layer pool."""
    spec = dataclasses.replace(spec, layer_id=0, kv_owner=0)  # the only layer of its pool
    allocator = SWATokenAllocator(tokens, tokens, device)
    pool = HybridKVPool([spec], allocator, kv_dtype, device)
    req_to_token = ReqToTokenPool(1, REQ_TO_TOKEN_COLUMNS, device)
    row = req_to_token.alloc()
    req_to_token.write(row, 0, allocator.alloc(tokens))
    k_buffer, v_buffer = pool.kv_buffers(0)
    for buffer in (k_buffer, v_buffer):  # float8 tensors have no normal_: drawn in bf16, then cast
        buffer.copy_(torch.randn(buffer.shape, device=device, dtype=DTYPE).to(buffer.dtype))
    positions = torch.arange(tokens, device=device)
    visible = (positions + 1).clamp(max=spec.sliding_window or tokens)
    return ExtendInputs(
        q=torch.randn(tokens, spec.num_heads, spec.head_dim, device=device, dtype=DTYPE),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token.req_to_token,
        full_to_swa=allocator.full_to_swa,
        req_pool_indices=torch.tensor([row], dtype=torch.int64, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int64, device=device),
        extend_seq_lens=torch.tensor([tokens], dtype=torch.int64, device=device),
        positions=positions,
        window=spec.sliding_window,
        flops=4.0 * spec.num_heads * spec.head_dim * float(visible.sum()),
    )


def grid_configs(spec: AttentionLayerSpec, kv_dtype: torch.dtype = DTYPE) -> list[ExtendConfig]:
    """The grid for one layer: heads per program 1, 2, 4 (up to its GQA group), the query rows filling block_m."""
    group = spec.num_heads // spec.num_kv_heads
    per_prog = [h for h in (1, 2, 4) if h <= group]
    configs = {default_extend_config(spec.head_dim, group, on_gpu=True, element_size=kv_dtype.itemsize)}
    for block_m, heads, block_n, warps, stages, splits in product(
        GRID["block_m"], per_prog, GRID["block_n"], GRID["warps"], GRID["stages"], GRID["value_splits"]
    ):
        config = ExtendConfig(block_m // heads, heads, block_n, warps, stages, splits)
        if fits(config, spec.head_dim):
            configs.add(config)
    return sorted(configs, key=dataclasses.astuple)


def fits(config: ExtendConfig, head_dim: int) -> bool:
    """Whether the fp32 accumulator fits the registers (<= 128 a thread) and the pipelined K/V blocks and the
    query tile fit an H100's 228 KB of shared memory: the rest fail or spill, and take long to compile."""
    block_m, value_dim = config.block_q * config.heads_per_prog, head_dim // config.value_splits
    accumulator = block_m * value_dim / (config.num_warps * 32)
    shared = 2 * ((head_dim + value_dim) * config.block_n * config.num_stages + block_m * head_dim)
    return accumulator <= 128 and shared <= 228 * 1024


def _compile_worker(layer: tuple[AttentionLayerSpec, torch.dtype], configs: list[ExtendConfig]) -> int:
    """(Worker process) launch each config once on a tiny prompt, so Triton compiles it into its disk cache."""
    spec, kv_dtype = layer
    inputs = build_inputs(spec, tokens=64, device=torch.device("cuda"), kv_dtype=kv_dtype)
    out = torch.empty_like(inputs.q)
    failed = 0
    for config in configs:
        try:
            inputs.run(out, config, inputs.tiles(config))
        except Exception:  # out of shared memory / registers: reported by the timing process
            failed += 1
    torch.cuda.synchronize()
    return failed


def time_config(inputs: ExtendInputs, config: ExtendConfig, reference: torch.Tensor | None, repeats: int) -> dict:
    """Output (max abs diff against `reference`) and median device time of one call."""
    record = dataclasses.asdict(config)
    out = torch.full_like(inputs.q, float("nan"))
    tiles = inputs.tiles(config)
    call = lambda: inputs.run(out, config, tiles)
    try:
        call()
        diff = 0.0 if reference is None else float((out.float() - reference.float()).abs().max())
        seconds = time_cuda(call, warmup=3, repeats=repeats, use_graph=True)
    except Exception as exc:  # a block shape that does not fit the chip is a result too
        return {**record, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {**record, "us": seconds * 1e6, "tflops": inputs.flops / seconds / 1e12, "max_abs_diff": diff, "out": out}


def describe(record: dict) -> str:
    name = "m{} h{} n{} w{} st{} v{}".format(
        record["block_q"] * record["heads_per_prog"], record["heads_per_prog"], record["block_n"],
        record["num_warps"], record["num_stages"], record["value_splits"],
    )  # fmt: skip
    if "us" not in record:
        return f"{name} failed"
    return f"{name} {record['us']:8.1f} us {record['tflops']:5.0f} TF/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="Presets whose layers to tune.")
    parser.add_argument("--tokens", type=int, default=8192, help="Prompt length, prefilled whole.")
    parser.add_argument("--repeats", type=int, default=10, help="Timed calls per config (median).")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="Compile processes (0: compile inline).")
    parser.add_argument("--json", type=Path, help="Results file (default $OUT/tune_extend_attention.json).")
    parser.add_argument("--kinds", nargs="+", choices=("sliding", "full"), default=["sliding", "full"])
    parser.add_argument("--block-m", type=int, nargs="+", default=list(GRID["block_m"]), help="The grid's M values.")
    parser.add_argument("--value-splits", type=int, nargs="+", default=list(GRID["value_splits"]))
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                        help="K/V of the pool: auto (bf16) or fp8_e4m3 (the scales 1).")  # fmt: skip
    args = parser.parse_args()
    GRID.update(block_m=tuple(args.block_m), value_splits=tuple(args.value_splits))
    if not torch.cuda.is_available():
        raise SystemExit("tune_extend_attention needs a CUDA device")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else DTYPE
    layers = tuned_layers(args.models, args.kinds)
    configs = {spec: grid_configs(spec, kv_dtype) for _, spec in layers}
    if args.jobs > 0:
        precompile(_compile_worker, [((spec, kv_dtype), c) for spec, c in configs.items()], args.jobs, chunk=4)

    torch.manual_seed(0)
    results = []
    bar = tqdm(total=sum(len(c) for c in configs.values()), desc="time", unit="cfg")
    for model, spec in layers:
        short, kind = model.removeprefix("gemma-4-").removesuffix("-it"), spec.layer_type.split("_")[0]
        name = f"{short} {kind} d{spec.head_dim} {spec.num_heads}/{spec.num_kv_heads} x{args.tokens}"
        bar.set_postfix_str(name)
        inputs = build_inputs(spec, args.tokens, device, kv_dtype)
        default = inputs.default_config()
        default_record = time_config(inputs, default, None, args.repeats)
        reference = default_record.pop("out")
        tolerance = REL_DIFF_TOL * float(reference.float().abs().max())
        records = []
        for config in configs[spec]:
            record = time_config(inputs, config, reference, args.repeats)
            record.pop("out", None)
            records.append(record)
            bar.update()
        agree = [r for r in records if "us" in r and r["max_abs_diff"] <= tolerance]
        best = min(agree, key=lambda r: r["us"])
        bar.write(
            f"{name}: default {describe(default_record)} | best {describe(best)} "
            f"({default_record['us'] / best['us']:.2f}x) | {sum('us' not in r for r in records)} failed, "
            f"{sum('us' in r for r in records) - len(agree)} over diff tol"
        )
        layer = {"shape": name, "model": model, "layer": dataclasses.asdict(spec), "tokens": args.tokens}
        results.append({**layer, "default": default_record, "best": best, "diff_tol": tolerance, "configs": records})
        del inputs, reference
        torch.cuda.empty_cache()
    bar.close()

    print(f"\n{'shape':34} {'default':>42} {'best':>42} {'speedup':>8}")
    for r in results:
        speedup = r["default"]["us"] / r["best"]["us"]
        print(f"{r['shape']:34} {describe(r['default']):>42} {describe(r['best']):>42} {speedup:7.2f}x")
        top = sorted((c for c in r["configs"] if "us" in c and c["max_abs_diff"] <= r["diff_tol"]),
                     key=lambda c: c["us"])[:5]  # fmt: skip
        for c in top:
            print(f"{'':34} {describe(c):>42}")
    payload = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": triton.__version__, "kv_cache_dtype": args.kv_cache_dtype, "grid": GRID,
               "results": results}  # fmt: skip
    path = write_json(args.json, "tune_extend_attention.json", payload)
    if path is not None:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
