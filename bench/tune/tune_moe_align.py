"""Time the MoE slot-layout kernel (`kernels/moe/align.py`) per slot chunk, at 26B-A4B's decode sizes.

    PYTHONPATH=. python bench/tune/tune_moe_align.py [--tokens 1 4 16 32] [--chunks 16 32 64 128 256] [--warps 4]

For each token count (8 of 128 experts each, 16-row blocks) and chunk, the kernel alone, 50 launches captured in a
CUDA graph and replayed once: us per launch. The kernel runs one program per expert, each counting every slot;
srt sizes the chunk to the slot count (`align.chunk_for`).
"""

from __future__ import annotations

import argparse

import torch

from srt.kernels.moe import align

EXPERTS, TOP_K, BLOCK_M, CALLS = 128, 8, 16, 50


def time_us(tokens: int, chunk: int, warps: int) -> float:
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]).cuda().int().reshape(-1)
    slots = ids.numel()
    max_blocks = align.max_blocks_for(slots, EXPERTS, BLOCK_M)
    slot_of_row = torch.empty(max_blocks * BLOCK_M, dtype=torch.int32, device="cuda")
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device="cuda")
    num_rows = torch.empty(1, dtype=torch.int64, device="cuda")

    def launch() -> None:
        align._align_kernel[(EXPERTS,)](
            ids, slot_of_row, block_expert, num_rows, slots, max_blocks, NUM_EXPERTS=EXPERTS,
            EXPERTS_POW2=EXPERTS, BLOCK_M=BLOCK_M, CHUNK=chunk, num_warps=warps,
        )  # fmt: skip

    for _ in range(5):
        launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()
    for tokens in args.tokens:
        slots = tokens * TOP_K
        for chunk in args.chunks:
            mark = " (srt)" if chunk == align.chunk_for(slots) else ""
            print(f"{slots} slots: CHUNK {chunk} warps {args.warps}: {time_us(tokens, chunk, args.warps):.2f} us{mark}")


if __name__ == "__main__":
    main()
