"""Fused experts for the Gemma 4 MoE block: the GPU path of `Experts`.

Both backends sort the token slots (slot = token * top_k + k) by expert once, with no read-back to the host,
then run one grouped GEMM for gate/up (gelu-tanh gating) and one for down over all experts, and sum each
token's top_k weighted outputs:

- "triton": `kernels/moe/experts.py` over slots padded to whole row blocks per expert (`ExpertBlocks`,
  made by one `kernels/moe/align.py` launch at decode sizes, by torch ops above them);
  gelu(gate) * up is fused into the first GEMM's epilogue and the routing weight into the second's. Any float
  dtype; runs on CUDA or under Triton's CPU interpreter.
- "grouped_mm": `torch._grouped_mm` (CUTLASS grouped GEMM, bf16 on Hopper) over the gathered token rows in
  expert order (`ExpertRuns`), gelu * up and the weighting in torch between and after.

FP8 experts (`Experts.quantize_fp8`: float8_e4m3fn weights, float32 scales per output channel) run on "triton"
only. At decode sizes its kernels upcast each weight tile to the activations' dtype and scale the accumulator's
columns in the epilogue (weight-only FP8: half the bytes streamed, the same activations). At prefill sizes on
FP8 tensor cores they run W8A8: the rows are quantized per token (and gelu(gate) * up per slot) by
`fp8_quant.quantize_fp8` and multiplied on the FP8 tensor cores, as the dense FP8 prefill GEMMs do
(`ExpertsConfig.w8a8`; float32 activations stay weight-only). grouped_mm refuses FP8 weights (bf16 only), so
`default_backend` picks triton for them.

`fused_experts` runs the one asked for, or `default_backend`'s pick, and raises ValueError where neither can
run (`Experts.forward` calls it only on CUDA or when a backend is forced). The torch loop
`Experts.forward_reference` stays the CPU path and the oracle of the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from srt.kernels.fp8_quant import quantize_fp8
from srt.kernels.moe import align as align_kernel
from srt.kernels.moe import experts as experts_kernels
from srt.layers.graph_mode import in_cuda_graph_step
from srt.model_loader.fp8 import FP8

BACKENDS = ("triton", "grouped_mm")


class ExpertRuns(NamedTuple):
    """The slots in expert order (stable: by slot within an expert) and where each expert's run ends."""

    order: torch.Tensor  # [slots] int64: slot ids sorted by expert
    experts: torch.Tensor  # [slots] int64: the expert of each slot in `order` (ascending)
    counts: torch.Tensor  # [experts] int64: slots routed to each expert
    ends: torch.Tensor  # [experts] int64: cumulative counts


class ExpertBlocks(NamedTuple):
    """Slots laid out in row blocks of one expert each (the triton kernels' input; diagram there)."""

    slot_of_row: torch.Tensor  # [blocks * block_m] int32: slot id, or num_slots for padding rows
    block_expert: torch.Tensor  # [blocks] int32: the expert of each block (clamped past num_rows)
    num_rows: torch.Tensor  # [1] int64: rows in use = sum of the padded runs


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertRuns:
    """Group the slots of `expert_ids` [tokens, top_k] by expert, on the device."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return ExpertRuns(order, experts, counts, torch.cumsum(counts, 0))


def pad_to_blocks(runs: ExpertRuns, block_m: int) -> ExpertBlocks:
    """Pad each expert's run of slots to a multiple of block_m rows.

    The number of blocks is bounded from shapes alone (every non-empty run wastes < block_m rows and at most
    min(experts, slots) runs are non-empty), so the grid needs no read-back and CUDA graphs can capture it.
    """
    num_slots = runs.order.numel()
    num_experts = runs.counts.numel()
    device = runs.order.device
    padded = (runs.counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    rank_in_run = torch.arange(num_slots, device=device) - (runs.ends - runs.counts)[runs.experts]
    rows = (padded_ends - padded)[runs.experts] + rank_in_run
    max_blocks = -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)
    slot_of_row = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    slot_of_row[rows] = runs.order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(slot_of_row, block_expert.to(torch.int32), padded_ends[-1:])


def _combine(per_slot: torch.Tensor, tokens: int, top_k: int, combine: bool = True) -> torch.Tensor:
    """Sum each token's top_k weighted expert outputs (float32 accumulation, output in the slot dtype); with
    `combine` False, the unsummed [tokens, top_k, hidden] view, for a kernel that sums them itself."""
    slots = per_slot.view(tokens, top_k, -1)
    return slots.sum(dim=1) if combine else slots


def triton_experts(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    config: experts_kernels.ExpertsConfig | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """The experts through the two Triton grouped-GEMM kernels; with FP8 weights, their float32 scales
    per output channel (gate_up_scale [experts, 2 * inter], down_scale [experts, hidden]). `combine`: as
    `fused_experts`."""
    tokens, top_k = expert_ids.shape
    num_experts = gate_up_proj.shape[0]
    if config is None:
        w8a8 = experts_kernels.w8a8_possible(hidden, gate_up_proj)
        config = experts_kernels.default_experts_config(
            tokens * top_k, num_experts, hidden.is_cuda, fp8=gate_up_proj.dtype == FP8, w8a8=w8a8
        )
    if expert_ids.numel() <= align_kernel.ALIGN_MAX_SLOTS:  # decode sizes: one launch, not ~20
        blocks = ExpertBlocks(*align_kernel.align_slots(expert_ids, num_experts, config.block_m))
    else:
        blocks = pad_to_blocks(sort_by_expert(expert_ids, num_experts), config.block_m)
    hidden, gate_up_proj, down_proj = hidden.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    flat_weights = weights.reshape(-1).float().contiguous()
    if not config.w8a8:
        act = experts_kernels.grouped_gate_up(hidden, gate_up_proj, *blocks, top_k, config, gate_up_scale)
        per_slot = experts_kernels.grouped_down(act, down_proj, flat_weights, *blocks, config, down_scale)
        return _combine(per_slot, tokens, top_k, combine)
    # W8A8: each token's row, then each slot's gelu(gate) * up, quantized with one scale per row
    x_q, x_scale = quantize_fp8(hidden, use_triton=hidden.is_cuda)
    act = experts_kernels.grouped_gate_up(
        x_q, gate_up_proj, *blocks, top_k, config, gate_up_scale, x_scale, out_dtype=hidden.dtype
    )
    act_q, act_scale = quantize_fp8(act, use_triton=hidden.is_cuda)
    per_slot = experts_kernels.grouped_down(
        act_q, down_proj, flat_weights, *blocks, config, down_scale, act_scale, out_dtype=hidden.dtype
    )
    return _combine(per_slot, tokens, top_k, combine)


def grouped_mm_experts(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    combine: bool = True,
) -> torch.Tensor:
    """The experts through torch._grouped_mm (bf16): gather rows in expert order, two grouped GEMMs, scatter.
    `combine`: as `fused_experts`."""
    tokens, top_k = expert_ids.shape
    runs = sort_by_expert(expert_ids, gate_up_proj.shape[0])
    offs = runs.ends.to(torch.int32)
    x = hidden[runs.order // top_k]
    # [E, 2I, H] viewed as [E, H, 2I] (column-major per expert): the layout grouped_mm takes without a copy
    gate, up = torch._grouped_mm(x, gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    # the routing weight scales the [slots, inter] activations, not the 4x wider [slots, hidden] outputs
    act = (F.gelu(gate, approximate="tanh") * up * weights.reshape(-1)[runs.order, None]).to(hidden.dtype)
    per_slot = torch.empty(tokens * top_k, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    per_slot[runs.order] = torch._grouped_mm(act, down_proj.transpose(1, 2), offs=offs)
    return _combine(per_slot, tokens, top_k, combine)


def grouped_mm_supported(hidden: torch.Tensor, fp8: bool = False) -> bool:
    """torch._grouped_mm runs bf16 on CUDA devices of compute capability 9.0 and up (Hopper); not FP8 weights
    (`fp8`: see the module docstring)."""
    return (
        not fp8
        and hasattr(torch, "_grouped_mm")
        and hidden.dtype == torch.bfloat16
        and hidden.is_cuda
        and torch.cuda.get_device_capability(hidden.device) >= (9, 0)
    )


def triton_supported(hidden: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA, or on the CPU when they were decorated under TRITON_INTERPRET=1."""
    return experts_kernels.runs_on(hidden.device)


# Eager H100 timings (docs/benchmarks.md, MoE): grouped_mm is faster up to 512 tokens (fewer host-side launches
# around its GEMMs), triton at 8192 (2.5 vs 3.4 ms); the crossover, interpolated, is near 1000 tokens. Under
# CUDA graphs triton was faster at every size measured.
GROUPED_MM_MAX_TOKENS = 1024


def default_backend(hidden: torch.Tensor, fp8: bool = False) -> str | None:
    """The fastest backend that runs on `hidden` [tokens, hidden] (with FP8 expert weights if `fp8`), or
    None: only the torch loop runs.

    Eager, grouped_mm's fewer launches win below GROUPED_MM_MAX_TOKENS; in a CUDA-graph step (decode)
    launches cost nothing and triton's kernels are the faster ones at every size (docs/benchmarks.md).
    FP8 weights run on triton only.
    """
    eager_small = hidden.shape[0] < GROUPED_MM_MAX_TOKENS and not (hidden.is_cuda and in_cuda_graph_step())
    if grouped_mm_supported(hidden, fp8) and (eager_small or not triton_supported(hidden)):
        return "grouped_mm"
    if triton_supported(hidden):
        return "triton"
    return None


def fused_experts(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    backend: str | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(gelu_tanh(gate_e(x_t)) * up_e(x_t)), e = expert_ids[t, k]; [tokens, hidden].

    `backend`: "triton", "grouped_mm", or None for `default_backend`. FP8 weights (float8_e4m3fn) come with
    their float32 per-output-channel scales `gate_up_scale` [experts, 2 * inter] and `down_scale`
    [experts, hidden]. `combine` False: the k terms unsummed, [tokens, top_k, hidden] (the caller's kernel sums
    them: `norm.moe_outputs_add_then_norm`). Raises ValueError if no backend can run.
    """
    fp8 = gate_up_proj.dtype == FP8
    if fp8 != (down_proj.dtype == FP8) or fp8 != (gate_up_scale is not None and down_scale is not None):
        raise ValueError("FP8 experts need both weights in float8_e4m3fn and both scales; 16-bit ones neither")
    backend = backend or default_backend(hidden, fp8)
    if expert_ids.numel() == 0:
        return torch.zeros_like(hidden) if combine else hidden.new_zeros(hidden.shape[0], 1, hidden.shape[1])
    if backend == "triton" and triton_supported(hidden):
        return triton_experts(
            hidden, gate_up_proj, down_proj, weights, expert_ids, gate_up_scale=gate_up_scale, down_scale=down_scale,
            combine=combine,
        )  # fmt: skip
    if backend == "grouped_mm" and grouped_mm_supported(hidden, fp8):
        return grouped_mm_experts(hidden, gate_up_proj, down_proj, weights, expert_ids, combine)
    weight_dtype = "float8_e4m3fn weights" if fp8 else f"{gate_up_proj.dtype} weights"
    raise ValueError(
        f"no fused experts backend runs {hidden.dtype} with {weight_dtype} on {hidden.device} (asked for {backend!r})"
    )
