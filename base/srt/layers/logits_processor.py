"""Final logits: only the rows the caller needs, through the tied LM head, with Gemma's softcapping."""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.layers.triton_support import jit, pdl_launch, pdl_start, runs_triton, tl, triton


class LogitsOutput(NamedTuple):
    logits: torch.Tensor  # [rows, vocab] float32, softcapped
    hidden_states: torch.Tensor  # [rows, hidden] final-norm hidden states of those rows (MTP drafts from them)
    yoco_skipped_rows: int = 0  # rows of the batch the KV-shared layers skipped (YOCO fast prefill)


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(hidden @ W^T / softcap), in float32."""
    logits = hidden @ lm_head_weight.T
    if softcap is None:
        return logits.float()
    return softcap_logits(logits, softcap)


def softcap_logits_reference(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(logits.float() / softcap) * softcap


@jit
def _softcap_kernel(logits_ptr, out_ptr, n, softcap, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32) / softcap
    # tanh from exp(-2|y|) (no overflow); near 0 its Taylor series, where 1 - e would cancel
    e = tl.exp(-2.0 * tl.abs(y))
    large = (1.0 - e) / (1.0 + e)
    y2 = y * y
    small = tl.abs(y) * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0)))
    tanh_abs = tl.where(tl.abs(y) < 0.01, small, large)
    tl.store(out_ptr + offsets, tl.where(y < 0, -tanh_abs, tanh_abs) * softcap, mask=mask)


def softcap_logits(logits: torch.Tensor, softcap: float, use_triton: bool | None = None) -> torch.Tensor:
    """softcap * tanh(logits / softcap) in float32, from logits of any float dtype: one pass on GPU, where
    torch takes four (the cast, the division, tanh, the product) over [rows, 262144] float32 values."""
    if not runs_triton(logits.device, use_triton, _softcap_kernel):
        return softcap_logits_reference(logits, softcap)
    logits = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    n, block = logits.numel(), 4096
    if n:
        launch = pdl_launch(logits.device, _softcap_kernel)
        _softcap_kernel[(triton.cdiv(n, block),)](
            logits, out, n, float(softcap), BLOCK=block, USE_PDL=bool(launch), num_warps=8, **launch
        )
    return out
