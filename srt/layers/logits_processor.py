"""Final logits: only the rows the caller needs, through the tied LM head, with Gemma's softcapping."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogitsOutput(NamedTuple):
    logits: torch.Tensor  # [rows, vocab] float32, softcapped
    hidden_states: torch.Tensor  # [rows, hidden] final-norm hidden states of those rows (MTP drafts from them)
    yoco_skipped_rows: int = 0  # rows of the batch the KV-shared layers skipped (YOCO fast prefill)


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(hidden @ W^T / softcap), in float32."""
    logits = (hidden @ lm_head_weight.T).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
