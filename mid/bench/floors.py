"""Roofline floors of a prefill and of a decode step, from the model's config and the device's measured rates.

    floor = max(FLOPs / matmul rate, bytes / copy bandwidth)

Rates are measured on the device (`measure_device_rates`): copy bandwidth from a device-to-device copy (bytes
read + written over time), matmul rate from an n x n x n matmul in the model's dtype.

FLOPs: matmuls only (2 per multiply-add): each layer's projections, MLP, MoE router and top-k experts, the
per-layer-input (PLE) gate and projection, attention over the (query, key) pairs the causal / sliding mask
keeps (`layer_flops`); the PLE model projection per token; the LM head per logits row. A prefill needs logits
for each prompt's last row only, so with KV-shared layers (E2B, E4B) the floor runs those layers on that row
alone (YOCO: exact, it is what srt runs by default). Norms, RoPE and softmax are not counted.

Bytes: the weights a forward reads plus the KV it reads and writes; activations are not counted.
- Every matrix of every layer, the PLE model projection and the LM head: read once per forward.
- Embedding tables are gathered by row: embed_tokens is read in full only as the tied LM head (counted once,
  there), and each token reads one row of embed_tokens and one of embed_tokens_per_layer.
- MoE layers read only the experts the batch routes to. With T tokens each picking top_k = k of E experts,
  assuming the picks are uniform and independent across tokens, an expert is missed by every token with
  probability (1 - k/E)^T, so E * (1 - (1 - k/E)^T) distinct experts per layer are expected. Trained routers
  are skewed, which touches fewer experts: there the floor is a little high.
- KV: every attention layer reads the K and V of the keys its queries see (a KV-shared layer re-reads its
  owner's buffer; a sliding layer sees at most its window); the layers that own KV write the new tokens'.

A decode floor is the mean over the timed steps of each step's floor (the context grows by one per step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from timing import time_cuda

from srt.configs.model_config import ModelConfig
from srt.mem_cache.kv_pool import layer_kv_bytes


class DeviceRates(NamedTuple):
    """Measured rates of the device: what the floors divide by."""

    copy_bytes_per_s: float  # (bytes read + bytes written) / time of a large device-to-device copy
    matmul_flops_per_s: float  # 2 n^3 / time of an n x n x n matmul in the model's dtype
    copy_bytes: int  # size of the copied tensor
    matmul_size: int  # n

    def as_json(self) -> dict:
        return {
            "copy_GBps": self.copy_bytes_per_s / 1e9,
            "matmul_TFLOPs": self.matmul_flops_per_s / 1e12,
            "copy_bytes": self.copy_bytes,
            "matmul_size": self.matmul_size,
        }


def measure_device_rates(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> DeviceRates:
    """Copy bandwidth and matmul rate on `device` (medians of `repeats` timed runs).

    GPU: a 1 GiB copy (far beyond L2) and an 8192^3 matmul. CPU: 64 MiB and 1024^3, so a CPU run stays quick;
    those are CPU rates and give CPU floors.
    """
    on_gpu = device.type == "cuda"
    copy_bytes, size = (1024**3, 8192) if on_gpu else (64 * 1024**2, 1024)
    copy_s = _time_copy(copy_bytes, device, repeats)
    matmul_s = _time_matmul(size, device, dtype, repeats)
    if on_gpu:
        torch.cuda.empty_cache()  # hand the buffers back before the runner sizes its KV pools from free memory
    return DeviceRates(2 * copy_bytes / copy_s, 2 * size**3 / matmul_s, copy_bytes, size)


def _time_copy(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src), warmup=3, repeats=repeats, device=device)


def _time_matmul(size: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return time_cuda(lambda: a @ b, warmup=3, repeats=repeats, device=device)


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a layer is expected to run for `tokens` tokens, picks uniform and independent."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


class WeightCounts(NamedTuple):
    """Weight elements of the text model, grouped by how a forward reads them."""

    dense: int  # read in full by every forward: layer matrices (not experts), PLE projection, LM head
    expert: int  # one expert of one MoE layer (gate_up + down)
    moe_layers: int
    num_experts: int
    top_k: int
    row: int  # gathered per token: one row of embed_tokens and one of embed_tokens_per_layer
    tables: int  # the embedding tables beyond the tied LM head (only their rows are read)
    projections: int = 0  # the decoder layers' q/k/v/o and gate/up/down elements (part of dense)

    def read(self, tokens: int) -> float:
        """Elements a forward of `tokens` rows reads."""
        experts = expected_distinct_experts(self.num_experts, self.top_k, tokens) if self.moe_layers else 0.0
        return self.dense + self.moe_layers * experts * self.expert + tokens * self.row

    def read_bytes(self, tokens: int, dtype: torch.dtype, fp8_projections: bool = False) -> float:
        """Bytes a forward of `tokens` rows reads: `read` in `dtype`, the dense projections in one byte each
        with `fp8_projections` (`--quantization fp8`; their scales are negligible)."""
        fp8_saving = self.projections * (dtype.itemsize - 1) if fp8_projections else 0
        return self.read(tokens) * dtype.itemsize - fp8_saving

    @property
    def total(self) -> int:
        """Every weight matrix and embedding table (norm and scale vectors are not counted)."""
        return self.dense + self.moe_layers * self.num_experts * self.expert + self.tables


def weight_counts(config: ModelConfig) -> WeightCounts:
    """Weight elements of the model, from its config."""
    hf = config.hf_text_config
    hidden, ple, layers = hf.hidden_size, hf.hidden_size_per_layer_input or 0, config.num_layers
    dense = projections = 0
    for spec in config.layers:
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv_projections = 0 if not spec.owns_kv else (1 if spec.k_eq_v else 2)
        layer_projections = hidden * (2 * q_width + kv_projections * kv_width + 3 * _mlp_width(config, spec.owns_kv))
        projections += layer_projections
        dense += layer_projections + hidden * 2 * ple
        if config.is_moe:
            dense += hidden * hf.num_experts  # router projection
    dense += hidden * layers * ple  # per_layer_model_projection
    dense += hf.vocab_size * hidden  # LM head (embed_tokens when tied)
    ple_vocab = hf.vocab_size_per_layer_input if ple else 0
    tables = ple_vocab * layers * ple + (0 if hf.tie_word_embeddings else hf.vocab_size * hidden)
    return WeightCounts(
        dense=dense,
        expert=3 * hidden * hf.moe_intermediate_size if config.is_moe else 0,
        moe_layers=layers if config.is_moe else 0,
        num_experts=hf.num_experts if config.is_moe else 0,
        top_k=hf.top_k_experts if config.is_moe else 0,
        row=hidden + layers * ple,
        tables=tables,
        projections=projections,
    )


def _mlp_width(config: ModelConfig, owns_kv: bool) -> int:
    hf = config.hf_text_config
    # KV-shared layers of double-wide checkpoints (E2B) have twice the MLP width
    return hf.intermediate_size * (2 if hf.use_double_wide_mlp and not owns_kv else 1)


def layer_flops(config: ModelConfig, positions: list[int], yoco_rows: list[int] | None) -> float:
    """Matmul FLOPs of the decoder layers for query rows at `positions` (one prompt).

    Projections, MLP, MoE router and top-k experts, and per-layer-input gates cost 2 * in * out per row;
    attention costs 4 * heads * head_dim per (query, visible key) pair, counting only pairs the causal /
    sliding mask keeps. With `yoco_rows` (indices into `positions`), KV-shared layers run on those rows only.
    """
    hf = config.hf_text_config
    hidden, ple = hf.hidden_size, hf.hidden_size_per_layer_input or 0
    moe = hf.num_experts + 3 * hf.top_k_experts * hf.moe_intermediate_size if config.is_moe else 0
    total = 0.0
    for spec in config.layers:
        rows = positions if spec.owns_kv or yoco_rows is None else [positions[i] for i in yoco_rows]
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv_projections = 0 if not spec.owns_kv else (1 if spec.k_eq_v else 2)
        mlp_width = _mlp_width(config, spec.owns_kv)
        per_row = 2 * hidden * (2 * q_width + kv_projections * kv_width + 3 * mlp_width + 2 * ple + moe)
        keys = sum(pos + 1 if spec.sliding_window is None else min(pos + 1, spec.sliding_window) for pos in rows)
        total += per_row * len(rows) + 4 * q_width * keys
    return total


def _outside_layer_flops(config: ModelConfig, tokens: int, logits_rows: int) -> float:
    """PLE model projection for every token, LM head for the logits rows."""
    hf = config.hf_text_config
    ple = hf.hidden_size_per_layer_input or 0
    return 2 * hf.hidden_size * (tokens * config.num_layers * ple + logits_rows * hf.vocab_size)


class Floor(NamedTuple):
    seconds: float
    flops: float
    bytes: float
    bound: str  # "compute" or "memory": which term of the max

    def as_json(self) -> dict:
        return {"seconds": self.seconds, "flops": self.flops, "bytes": self.bytes, "bound": self.bound}


def roofline(flops: float, nbytes: float, rates: DeviceRates) -> Floor:
    compute_s, memory_s = flops / rates.matmul_flops_per_s, nbytes / rates.copy_bytes_per_s
    return Floor(max(compute_s, memory_s), flops, nbytes, "compute" if compute_s >= memory_s else "memory")


def _kv_write_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    return sum(layer_kv_bytes(spec, dtype) for spec in config.layers if spec.owns_kv)


def prefill_floor(
    config: ModelConfig,
    dtype: torch.dtype,
    rates: DeviceRates,
    batch_size: int,
    input_len: int,
    fp8_projections: bool = False,
) -> Floor:
    """Floor of one prefill of `batch_size` fresh prompts of `input_len` tokens (logits of each last row)."""
    positions = list(range(input_len))
    yoco_rows = [input_len - 1] if config.first_kv_shared_layer is not None else None
    flops = batch_size * (layer_flops(config, positions, yoco_rows) + _outside_layer_flops(config, input_len, 1))
    tokens = batch_size * input_len
    weights = weight_counts(config).read_bytes(tokens, dtype, fp8_projections)
    nbytes = weights + tokens * _kv_write_bytes(config, dtype)
    # the KV a prompt's queries read back is the KV it just wrote (in L2 or registers for a fused kernel)
    return roofline(flops, nbytes, rates)


def decode_step_floor(
    config: ModelConfig,
    dtype: torch.dtype,
    rates: DeviceRates,
    batch_size: int,
    context: int,
    fp8_projections: bool = False,
) -> Floor:
    """Floor of one decode step of `batch_size` requests, each with `context` tokens after the step."""
    flops = batch_size * (layer_flops(config, [context - 1], None) + _outside_layer_flops(config, 1, 1))
    kv_read = sum(
        layer_kv_bytes(spec, dtype) * (context if spec.sliding_window is None else min(context, spec.sliding_window))
        for spec in config.layers
    )
    weights = weight_counts(config).read_bytes(batch_size, dtype, fp8_projections)
    return roofline(flops, weights + batch_size * (kv_read + _kv_write_bytes(config, dtype)), rates)


def decode_floor(
    config: ModelConfig,
    dtype: torch.dtype,
    rates: DeviceRates,
    batch_size: int,
    input_len: int,
    output_len: int,
    fp8_projections: bool = False,
) -> Floor:
    """Mean floor of the `output_len` decode steps after a prefill of `input_len` tokens (`fp8_projections`: the
    dense projections' weights read as one byte each).

    Decode step s (from 1) feeds the token at position input_len + s - 1, so its queries see input_len + s keys.
    """
    steps = [
        decode_step_floor(config, dtype, rates, batch_size, input_len + s, fp8_projections)
        for s in range(1, output_len + 1)
    ]
    flops = sum(step.flops for step in steps) / len(steps)
    nbytes = sum(step.bytes for step in steps) / len(steps)
    seconds = sum(step.seconds for step in steps) / len(steps)
    return Floor(seconds, flops, nbytes, roofline(flops, nbytes, rates).bound)
