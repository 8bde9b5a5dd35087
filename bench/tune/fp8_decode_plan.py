"""What the FP8 decode GEMM sweep (`tune_decode_gemm_fp8.py`) runs: each model's decode projections, the kernel
families and their tile candidates, how a config is called, and the parallel compile of every kernel first.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import NamedTuple

import torch

from srt.configs.model_config import ModelConfig
from srt.kernels.decode_gemm import GATED, GemmTiles
from srt.kernels.decode_gemm_fp8 import decode_gelu_mlp_fp8, decode_linear_fp8
from srt.kernels.decode_gemm_fp8_variants import VARIANTS, decode_gelu_mlp_fp8_variant, decode_linear_fp8_variant
from srt.layers.fp8_linear import Fp8Linear
from srt.layers.linear import TRITON_SPLITS

MODELS = {"E4B": "gemma-4-E4B-it", "26B-A4B": "gemma-4-26B-A4B-it", "31B": "gemma-4-31B-it"}
FAMILIES = ("fp8", *VARIANTS)  # "fp8": srt's kernel, the rest `decode_gemm_fp8_variants.VARIANTS`
DEFAULT_FAMILIES = ("fp8", "fp16", "swap_fp16", "w8a8")
SMEM_BYTES = 227 * 1024  # an H100 CTA's most shared memory
SPLITS_GRID = (1, 2, 3, 4, 6, 8)
SMS = 132  # an H100's SMs: the CTAs of one wave


def _tile_grid() -> list[GemmTiles]:
    """BLOCK_K 128 and 256 (FP8 rows of 128 / 256 bytes) at every width, depth and warps; 64 (for K-chunks that
    are no multiple of 128: 26B-A4B's and 31B's hidden sizes over 4 splits) at two depths. (Six stages never
    won in a first H100 run, nor did 8 warps at 64 columns.)"""
    grid = [
        GemmTiles(block_n, block_k, stages, warps)
        for block_n in (64, 128, 256)
        for block_k in (128, 256)
        for stages in (3, 4)
        for warps in (4, 8)
        if not (warps == 8 and block_n == 64)
    ]
    return grid + [GemmTiles(block_n, 64, stages) for block_n in (128, 256) for stages in (4, 6)]


TILE_GRID = _tile_grid()
SMOKE_TILES = [GemmTiles(64, 64, 2)]


class Projection(NamedTuple):
    """One decode projection of a model: out x in, the caller's K-splits (or GATED), and how many per step."""

    model: str
    name: str
    n: int  # output width; gate_up: both halves
    k: int
    kind: int | str  # TRITON_SPLITS (partial sums for a norm kernel) or GATED
    per_step: int

    @property
    def out_n(self) -> int:
        return self.n // 2 if self.kind == GATED else self.n


class Config(NamedTuple):
    family: str
    tiles: GemmTiles
    splits: int  # K-chunks; a gated GEMM's only for the variants, which sum them in the kernel


def projections(model: str) -> list[Projection]:
    """`model`'s dense decoder projections with their per-step counts, from its config (layers with the same
    shapes share one entry)."""
    config = ModelConfig.from_preset(MODELS[model])
    hf = config.hf_text_config
    hidden = hf.hidden_size
    counts: dict[tuple[str, int, int, int | str], int] = {}
    for spec in config.layers:
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv = 0 if not spec.owns_kv else (1 if spec.k_eq_v else 2)
        # KV-shared layers of double-wide checkpoints (E2B) have twice the MLP width
        width = hf.intermediate_size * (2 if getattr(hf, "use_double_wide_mlp", False) and not spec.owns_kv else 1)
        for name, n, k, kind in (
            ("qkv" if kv else "q", q_width + kv * kv_width, hidden, TRITON_SPLITS),
            ("o", hidden, q_width, TRITON_SPLITS),
            ("gate_up", 2 * width, hidden, GATED),
            ("down", hidden, width, TRITON_SPLITS),
        ):
            counts[(name, n, k, kind)] = counts.get((name, n, k, kind), 0) + 1
    return [Projection(model, f"{name} {n}x{k}", n, k, kind, c) for (name, n, k, kind), c in counts.items()]


def smoke_projections() -> list[Projection]:
    """Tiny shapes for the interpreter: a projection in 2 K-chunks at first, and a gate_up."""
    return [
        Projection("smoke", "linear 128x256", 128, 256, 2, 1),
        Projection("smoke", "gate_up 256x256", 256, 256, GATED, 1),
    ]


def _chunk(projection: Projection, splits: int) -> int:
    return projection.k // splits  # a gated GEMM's chunks too (the swapped variants sum them in the kernel)


def fits(projection: Projection, tiles: GemmTiles, splits: int, scale_block_k: int, family: str) -> bool:
    """Tiles divide the output, the K-chunks and the scale blocks; the stages (plus an upcast weight tile, which
    the non-swapped kernels' mma.sync may stage in shared memory) fit in an H100 CTA's shared memory."""
    chunk = _chunk(projection, splits)
    if projection.out_n % tiles.block_n or chunk % tiles.block_k or scale_block_k % tiles.block_k:
        return False
    if projection.k % splits or chunk // tiles.block_k < tiles.stages - 1:
        return False
    halves = 2 if projection.kind == GATED else 1
    stage = 32 * tiles.block_k * 2 + halves * tiles.block_n * tiles.block_k
    swapped = family in VARIANTS and VARIANTS[family].swap
    upcast = 0 if swapped else halves * tiles.block_n * tiles.block_k * 2
    return tiles.stages * stage + upcast <= SMEM_BYTES


def first_splits(projection: Projection, tiles: GemmTiles, scale_block_k: int, family: str) -> list[int]:
    """The splits each tile is first timed at: the caller's 4 where it divides, and the fewest splits that give a
    full wave of CTAs where that is another."""
    if projection.kind == GATED:
        return [1] if fits(projection, tiles, 1, scale_block_k, family) else []
    fitting = [s for s in SPLITS_GRID if fits(projection, tiles, s, scale_block_k, family)]
    full_wave = [s for s in fitting if projection.n // tiles.block_n * s >= SMS]
    chosen = {s for s in fitting if s == TRITON_SPLITS} | set(full_wave[:1] or fitting[-1:])
    return sorted(chosen)


def fp8_call(family: str, x: torch.Tensor, layer: Fp8Linear, kind: int | str, config: Config) -> torch.Tensor:
    """One call as srt makes it: [rows, N] (gelu * up for GATED) or [splits, rows, N] float32 partials."""
    args = (x, layer.weight, layer.weight_scale, layer.block_k)
    if family == "fp8":
        if kind == GATED:
            return decode_gelu_mlp_fp8(*args, tiles=config.tiles)
        return decode_linear_fp8(*args, splits=config.splits, tiles=config.tiles)
    if kind == GATED:
        return decode_gelu_mlp_fp8_variant(*args, family, tiles=config.tiles, splits=config.splits)
    return decode_linear_fp8_variant(*args, family, splits=config.splits, tiles=config.tiles)


def compile_key(config: Config, projection: Projection, rows: int, scale_block_k: int) -> tuple:
    """What a config's compiled kernel depends on besides its tiles: the row block (and rows == 1, which Triton
    specializes), gate_up or not, and for srt's kernel with per-channel scales K (it takes the scales' block
    width, K there, as a constexpr; the variants pass 1 and compile once for every K)."""
    per_k = config.family == "fp8" and scale_block_k >= projection.k
    block_m = max(16, 1 << (rows - 1).bit_length())
    return config.family, config.tiles, block_m, rows == 1, projection.kind == GATED, projection.k if per_k else None


def _compile(family: str, projection: Projection, rows: int, config: Config, scales: str) -> str | None:
    """In a worker process: one call at the projection's shape, which compiles the config's kernel into Triton's
    on-disk cache for the main process; the error, or None."""
    try:  # uninitialized weights: the call only has to compile and launch
        layer = Fp8Linear(projection.k, projection.n, None if scales == "channel" else (128, 128), device="cuda")
        x = torch.zeros(rows, projection.k, device="cuda", dtype=torch.bfloat16)
        fp8_call(family, x, layer, projection.kind, config)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(work: list[tuple[Projection, int]], families: list[str], grid: list[GemmTiles], scales: str,
               timeout_s: float) -> dict:  # fmt: skip
    """Compile every distinct kernel the sweep will launch, in parallel processes (a compile is CPU-bound and
    takes ~1 s; the main process then loads them from Triton's cache). Returns {kernel key: error} of those
    that failed; a kernel not done within timeout_s is left to the main process."""
    tasks = {}
    for projection, rows in work:
        block_k = 128 if scales == "block" else projection.k
        for family in families:
            for tiles in grid:
                splits = first_splits(projection, tiles, block_k, family)
                key = splits and compile_key(Config(family, tiles, splits[0]), projection, rows, block_k)
                if key and key not in tasks:
                    tasks[key] = (family, projection, rows, Config(family, tiles, splits[0]), scales)
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    print(f"compiling {len(tasks)} kernels in {workers} processes", flush=True)
    start, failed = time.perf_counter(), {}
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
    futures = {pool.submit(_compile, *task): key for key, task in tasks.items()}
    try:
        for done, future in enumerate(as_completed(futures, timeout=timeout_s), 1):
            error = future.result()
            if error is not None:
                failed[futures[future]] = error
            if done % 50 == 0:
                print(f"  {done}/{len(tasks)} compiled, {time.perf_counter() - start:.0f} s", flush=True)
    except TimeoutError:
        print(f"  compiling stopped after {timeout_s:.0f} s; the rest compile as they run", flush=True)
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"compiled in {time.perf_counter() - start:.0f} s, {len(failed)} failed", flush=True)
    return failed
