"""Final logits: only the rows the caller needs, through the tied LM head, with Gemma's softcapping."""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.distributed.collectives import gather_vocab
from srt.kernels.logits import Logits, softcap_logits


class LogitsOutput(NamedTuple):
    logits: torch.Tensor  # [rows, vocab] float32, softcapped
    hidden_states: torch.Tensor  # [rows, hidden] final-norm hidden states of those rows (MTP drafts from them)
    yoco_skipped_rows: int = 0  # rows of the batch the KV-shared layers skipped (YOCO fast prefill)
    greedy_ids: torch.Tensor | None = None  # [rows] int64 argmax of each row of `logits`, where the GPU found it


def compute_logits(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    softcap: float | None,
    tp_size: int = 1,
    vocab: int | None = None,
) -> Logits:
    """softcap * tanh(hidden @ W^T / softcap), in float32; on GPU with each row's argmax, found by the softcap
    kernel as it writes the logits (greedy sampling then reads no [rows, vocab] tensor again). Under tensor
    parallelism W is this rank's vocabulary slice: the products of every rank are gathered (the first
    `vocab` columns) before the softcap."""
    logits = hidden @ lm_head_weight.T
    if tp_size > 1:
        if vocab is None:
            raise ValueError("compute_logits under tensor parallelism needs the vocabulary size")
        logits = gather_vocab(logits, tp_size, vocab)
    if softcap is None:
        return Logits(logits.float(), None)
    return softcap_logits(logits, softcap, with_argmax=True)
