"""The collectives of a tensor-parallel forward, on torch.distributed's default group (NCCL on GPUs, gloo on
CPUs). Each is the identity at one rank, so the model calls them unconditionally.

Where they sit in a Gemma 4 layer (TP = N, every rank holds 1/N of the heads and of the MLP width):

    hidden (every rank: all of it) -> q/k/v (this rank's heads) -> attention -> o (this rank's columns)
        -> reduce_sum -> residual add + norm -> gate/up (this rank's columns) -> down -> reduce_sum -> ...

Row-parallel outputs at decode sizes come as float32 K-split partial sums (`layers/linear.py`): `reduce_sum`
adds the splits first and all-reduces the float32 sum once, which the norm kernel then reads as one split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_sum(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """The sum over ranks of a row-parallel output: [T, N], or [splits, T, N] float32 partial sums (returned as
    [1, T, N], still the partial-sum form the norm kernels take)."""
    if tp_size == 1:
        return x
    if x.dim() == 3:
        x = x.sum(dim=0, keepdim=True)
    dist.all_reduce(x)
    return x


def gather_vocab(local: torch.Tensor, tp_size: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] from every rank's [rows, vocab / N] slice of a vocab-parallel product (rank order), without
    the padding rows of the last rank's table."""
    if tp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab]


def vocab_parallel_rows(table: torch.Tensor, ids: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    """The rows of `ids` of a table split by vocabulary (this rank holds rows [rank * R, (rank + 1) * R)): each
    rank looks up its own ids, zeros elsewhere, and the sum over ranks has every row exactly once."""
    if tp_size == 1:
        return table[ids]
    start = rank * table.shape[0]
    local = ids - start
    mine = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)] * mine.unsqueeze(-1).to(table.dtype)
    dist.all_reduce(rows)
    return rows
