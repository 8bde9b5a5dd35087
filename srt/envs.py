"""Every environment switch srt reads, in one place; docs/usage.md lists them.

Switches are for A/B runs and debugging; everything a user configures is a flag of `ServerArgs`. Each switch
says when it is read: a switch read at import time must be set before srt is imported (in the shell, or the
environment of a launched server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Switch:
    """An on/off environment variable: a default-on switch is off only when set to "0", a default-off one is
    on only when set to "1"."""

    name: str
    default: bool
    read: str  # when srt reads it
    help: str

    def enabled(self) -> bool:
        value = os.environ.get(self.name, "").strip()
        if not value:
            return self.default
        return value != "0" if self.default else value == "1"


GEMMA4_YOCO = Switch(
    "GEMMA4_YOCO",
    True,
    "when the model is built",
    "YOCO fast prefill: the KV-shared layers run on the rows whose logits are needed only; 0 runs them on "
    "every row (A/B runs).",
)
SRT_TRITON_GEMM = Switch(
    "SRT_TRITON_GEMM",
    True,
    "at import",
    "Decode-sized projections on the chained Triton GEMM (Hopper); 0 leaves every projection to cuBLAS.",
)
SRT_PDL = Switch(
    "SRT_PDL",
    True,
    "at import",
    "Chained kernel launches (programmatic dependent launch, Hopper); 0 launches each kernel after the last.",
)
SRT_FP8_GEMV = Switch(
    "SRT_FP8_GEMV",
    True,
    "at import",
    "One-row FP8 projections on the CUDA-core kernel (Hopper); 0 gives them to the W8A8 tensor-core GEMM (A/B runs).",
)
SRT_MOE_SIDE_STREAM = Switch(
    "SRT_MOE_SIDE_STREAM",
    True,
    "at import",
    "An MoE layer's dense MLP on a side stream beside its router and experts (CUDA); 0 runs it first (A/B runs).",
)
SRT_L2_PREFETCH = Switch(
    "SRT_L2_PREFETCH",
    True,
    "at import",
    "Chained FP8 decode projections prefetch their first weight bytes into L2 before they wait for the kernel ahead "
    "(Hopper); 0 does not (A/B runs).",
)
SRT_DEBUG_KV_INDICES = Switch(
    "SRT_DEBUG_KV_INDICES",
    False,
    "at every check",
    "1 checks every KV slot index before it reaches a kernel (slow; for debugging out-of-range reads).",
)

SWITCHES = (
    GEMMA4_YOCO,
    SRT_TRITON_GEMM,
    SRT_PDL,
    SRT_FP8_GEMV,
    SRT_MOE_SIDE_STREAM,
    SRT_L2_PREFETCH,
    SRT_DEBUG_KV_INDICES,
)

SRT_SIMULATE_ACCEPT_LEN = "SRT_SIMULATE_ACCEPT_LEN"


def simulated_accept_len() -> float | None:
    """SRT_SIMULATE_ACCEPT_LEN, read when the scheduler starts: benchmarks on random weights only, verify accepts
    this many tokens per round on average (bonus included, >= 1) whatever the drafts are. Changes outputs."""
    value = os.environ.get(SRT_SIMULATE_ACCEPT_LEN, "").strip()
    if not value:
        return None
    accept_len = float(value)
    if not accept_len >= 1.0:
        raise ValueError(f"{SRT_SIMULATE_ACCEPT_LEN} must be >= 1 (tokens per verify round); got {value!r}")
    return accept_len


SRT_STEP_TRACE = "SRT_STEP_TRACE"


def step_trace_path() -> str | None:
    """SRT_STEP_TRACE, read when a scheduler starts: the path prefix of its timeline (`managers/step_trace.py`;
    one file PATH.<pid> per scheduler process), None when unset."""
    return os.environ.get(SRT_STEP_TRACE, "").strip() or None


def step_shaping_values() -> dict[str, str | None]:
    """The switches (and the simulated accept length) as set in this process: what tensor-parallel ranks must
    agree on, since they change which kernels and collectives a step runs."""
    names = [switch.name for switch in SWITCHES if switch is not SRT_DEBUG_KV_INDICES] + [SRT_SIMULATE_ACCEPT_LEN]
    return {name: os.environ.get(name) for name in names}


def cache_home() -> Path:
    """Where srt caches files it builds (the dummy presets' stand-in tokenizers): $XDG_CACHE_HOME/srt, by
    default ~/.cache/srt."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "srt"
