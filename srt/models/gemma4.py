"""Gemma 4 text model over paged KV (E2B, E4B, 26B-A4B, 31B).

Numerically it follows transformers' modeling_gemma4.py; parameter names are the checkpoint's, so a Hugging
Face directory loads as it is. What differs is the execution: a flat batch of token rows (ForwardBatch),
KV written to the pools by each KV-owning layer's fused q/k/v kernel (`qkv_norm_rope_store`) and read through
an attention backend, KV-shared layers with no K/V weights reading their owner's buffers, and logits only for
the rows the caller needs.

YOCO fast prefill (E2B, E4B): the KV-shared layers write no KV, so nothing later reads their output at a row
whose logits nobody needs. Before the first of them the batch shrinks to its logits rows:

    layers 0 .. first_shared-1   every row (they write the KV every later row reads)
    gather logits_rows           hidden, per-layer inputs; ForwardBatch.select_rows + metadata
    layers first_shared .. end   logits rows only, each attending over its request's whole prefix
    final norm, LM head          logits rows

With one logits row per request (the usual prefill) the second part has the shape of a decode step, so on
GPU it replays a captured CUDA graph (`shared_layer_graphs`) instead of launching ~20 kernels per layer.

`GEMMA4_YOCO=0` (read when the model is built) runs every layer on every row instead, for A/B runs.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from srt.configs.model_config import AttentionLayerSpec, ModelConfig
from srt.layers.attention.base import AttentionBackend
from srt.layers.fused_kernels import (
    add_rms_norm,
    add_rms_norm_then_norm,
    gelu_tanh_mul_packed,
    rms_norm_rope,
)
from srt.layers.layernorm import RMSNorm
from srt.layers.logits_processor import LogitsOutput, compute_logits
from srt.layers.moe.experts import Experts
from srt.layers.moe.router import Router
from srt.layers.ple_kernels import per_layer_input_projection
from srt.layers.qkv_norm_rope_store import QKVLayout, qkv_norm_rope_store
from srt.layers.rotary import RotaryEmbedding
from srt.layers.split_k import linear_partials
from srt.model_executor.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from srt.model_executor.cuda_graph_runner import SharedLayerGraphs

logger = logging.getLogger(__name__)

YOCO_ENV = "GEMMA4_YOCO"


def yoco_enabled_by_env() -> bool:
    """False only when the environment says `GEMMA4_YOCO=0` (YOCO is on by default)."""
    return os.environ.get(YOCO_ENV, "1").strip() != "0"


class ScaledEmbedding(nn.Embedding):
    """Embedding times a constant; the constant is rounded to the weight dtype first, as the reference does."""

    def __init__(self, num_embeddings: int, dim: int, scale: float) -> None:
        super().__init__(num_embeddings, dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


# Projection weights are stored transposed: a Linear's [out, in] weight is a view of a contiguous [in, out]
# tensor. F.linear then runs x @ W^T on a row-major W^T, which cuBLAS streams 2-8% faster at decode sizes on
# an H100 (bench/bench_gemm_layouts.py: gate_up 40.9 -> 38.9 us at 32 rows) with the same values.


@torch.no_grad()
def stack_linears(*linears: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose output is the given Linears' outputs side by side (one matmul, not several),
    its weight stored transposed."""
    weight_t = torch.cat([linear.weight.t() for linear in linears], dim=1)
    stacked = nn.Linear(weight_t.shape[0], weight_t.shape[1], bias=False, device="meta")  # no init work
    stacked.weight = nn.Parameter(weight_t.t())
    return stacked


@torch.no_grad()
def store_transposed(module: nn.Linear | nn.Embedding) -> None:
    """`module`'s 2-D weight, same values and shape, as a view of its contiguous transpose (no copy when it is
    one already)."""
    module.weight = nn.Parameter(module.weight.t().contiguous().t())


class Gemma4Attention(nn.Module):
    """q/k/v projections with q/k/v norms and RoPE; scaling 1.0. KV-shared layers have only q and o.

    Weights load into the checkpoint's q_proj / k_proj / v_proj; `fuse_projections` then stacks them into
    `qkv_proj` (q and k only on k_eq_v layers), the form `forward` runs.
    """

    def __init__(self, spec: AttentionLayerSpec, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.spec = spec
        dim, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
        self.q_proj = nn.Linear(hidden_size, heads * dim, bias=False)
        self.q_norm = RMSNorm(dim, eps=eps)
        self.qkv_proj: nn.Linear | None = None
        if spec.owns_kv:
            self.k_proj = nn.Linear(hidden_size, kv_heads * dim, bias=False)
            # k_eq_v layers (full layers of 26B/31B) take V from the K projection before its norm and RoPE
            self.v_proj = None if spec.k_eq_v else nn.Linear(hidden_size, kv_heads * dim, bias=False)
            self.k_norm = RMSNorm(dim, eps=eps)
            self.v_norm = RMSNorm(dim, eps=eps, with_scale=False)
            self.layout = QKVLayout(heads, kv_heads, dim, spec.k_eq_v)
        self.o_proj = nn.Linear(heads * dim, hidden_size, bias=False)

    def fuse_projections(self) -> None:
        if self.spec.owns_kv and self.qkv_proj is None:
            self.qkv_proj = stack_linears(*(p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None))
            del self.q_proj, self.k_proj, self.v_proj
        elif not self.spec.owns_kv:
            store_transposed(self.q_proj)
        store_transposed(self.o_proj)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens, dim = hidden.shape[0], self.spec.head_dim
        cos, sin = cos_sin
        if not self.spec.owns_kv:
            q = self._norm_rope(self.q_norm, self.q_proj(hidden).view(tokens, -1, dim), cos, sin)
            out = backend.forward(q, None, None, self.spec, batch, save_kv=False)
            return linear_partials(out.reshape(tokens, -1), self.o_proj.weight)
        if self.qkv_proj is None:
            raise RuntimeError("Gemma4Attention runs after fuse_projections() (load_model calls it)")
        # norms, RoPE and the K/V cache write in one kernel on GPU; the attention then reads the cache only
        q = qkv_norm_rope_store(
            self.qkv_proj(hidden),
            self.layout,
            self.q_norm,
            self.k_norm,
            self.v_norm,
            cos,
            sin,
            batch.kv_pool.cache_target(self.spec.layer_id),
            batch.out_cache_loc,
        )
        out = backend.forward(q, None, None, self.spec, batch, save_kv=False)
        return linear_partials(out.reshape(tokens, -1), self.o_proj.weight)

    @staticmethod
    def _norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rms_norm_rope(x, norm.weight, cos, sin, norm.eps)


class Gemma4MLP(nn.Module):
    """gelu-tanh gated MLP; `fuse_projections` stacks the checkpoint's gate_proj and up_proj into gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = stack_linears(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj
        store_transposed(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            raise RuntimeError("Gemma4MLP runs after fuse_projections() (load_model calls it)")
        # cuBLAS on the transposed weight, then gelu * up: a Triton GEMV with it folded in (skinny_gemm.py until
        # the 14th session) was slower on this layout
        return linear_partials(gelu_tanh_mul_packed(self.gate_up_proj(x)), self.down_proj.weight)


class Gemma4DecoderLayer(nn.Module):
    """Attention, dense MLP (+ MoE block on 26B-A4B), per-layer input, layer scalar."""

    def __init__(self, config: ModelConfig, spec: AttentionLayerSpec) -> None:
        super().__init__()
        hf = config.hf_text_config
        hidden, eps = hf.hidden_size, hf.rms_norm_eps
        self.self_attn = Gemma4Attention(spec, hidden, eps)
        # KV-shared layers of double-wide checkpoints (E2B) have twice the MLP width
        double_wide = bool(hf.use_double_wide_mlp) and not spec.owns_kv
        self.mlp = Gemma4MLP(hidden, hf.intermediate_size * (2 if double_wide else 1))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.has_moe = config.is_moe
        if self.has_moe:
            self.router = Router(hidden, hf.num_experts, hf.top_k_experts, eps)
            self.experts = Experts(hf.num_experts, hidden, hf.moe_intermediate_size)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.ple_dim = hf.hidden_size_per_layer_input or 0
        if self.ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, self.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(self.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        attn_input: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        backend: AttentionBackend,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new hidden, next_norm(new hidden) or None). `attn_input` is input_layernorm(hidden): the layer
        before computes it in the kernel of its last residual add, as this one does for `next_norm`. The
        attention and MLP outputs may come as K-split partial sums (`split_k.linear_partials`): the add + norm
        kernels after them take either form."""
        attn = self.self_attn(attn_input, cos_sin, batch, backend)
        hidden, mlp_input = add_norm_then_norm(
            self.post_attention_layernorm, attn, hidden, self.pre_feedforward_layernorm
        )

        residual = hidden
        mlp_out = self.mlp(mlp_input)
        if self.has_moe:
            # the router and the experts see the residual stream, not the dense MLP's input norm
            routing = self.router(residual)
            expert_out = self.experts(self.pre_feedforward_layernorm_2(residual), *routing)
            expert_out = self.post_feedforward_layernorm_2(expert_out)
            mlp_out = add_norm(self.post_feedforward_layernorm_1, mlp_out, expert_out)
        if not self.ple_dim:
            return add_norm_then_norm(self.post_feedforward_layernorm, mlp_out, residual, next_norm, self.layer_scalar)
        # the layer scalar multiplies the layer's last sum: the per-layer-input one here
        hidden = add_norm(self.post_feedforward_layernorm, mlp_out, residual)
        # gate GEMV, gelu * per-layer input, projection GEMV: two split-K kernels at decode sizes on GPU
        projected = per_layer_input_projection(
            hidden, per_layer_input, self.per_layer_input_gate.weight, self.per_layer_projection.weight
        )
        return add_norm_then_norm(self.post_per_layer_input_norm, projected, hidden, next_norm, self.layer_scalar)


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(residual + norm(x)) * scale in one fused kernel on GPU."""
    return add_rms_norm(x, residual, norm.weight if norm.with_scale else None, norm.eps, scale)


def add_norm_then_norm(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor,
    next_norm: RMSNorm | None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed, next_norm(summed)) with summed = (residual + norm(x)) * scale, in one fused kernel on GPU;
    (summed, None) without a next norm."""
    if next_norm is None:
        return add_norm(norm, x, residual, scale), None
    weight = norm.weight if norm.with_scale else None
    return add_rms_norm_then_norm(x, residual, weight, norm.eps, next_norm.weight, next_norm.eps, scale)


class TextModelOutput(NamedTuple):
    hidden_states: torch.Tensor  # [logits rows, hidden] after the final norm
    yoco_skipped_rows: int  # rows the KV-shared layers did not run on (0 without YOCO)


class Gemma4TextModel(nn.Module):
    """Embeddings, per-layer inputs (PLE), decoder layers, final norm. Parameter prefix `model.`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_text_config
        self.config = config
        self.embed_tokens = ScaledEmbedding(hf.vocab_size, hf.hidden_size, hf.hidden_size**0.5)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, spec) for spec in config.layers)
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf)
        self.ple_dim = hf.hidden_size_per_layer_input or 0
        if self.ple_dim:
            total = config.num_layers * self.ple_dim
            self.embed_tokens_per_layer = ScaledEmbedding(hf.vocab_size_per_layer_input, total, self.ple_dim**0.5)
            self.per_layer_model_projection = nn.Linear(hf.hidden_size, total, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.ple_dim, hf.rms_norm_eps)
        # the layer at which the batch shrinks to its logits rows (YOCO); None runs every row through
        self.yoco_layer: int | None = None
        self.set_yoco(yoco_enabled_by_env())
        # captured CUDA graphs of `run_shared_layers`, set by the ModelRunner when it captures them
        self.shared_layer_graphs: SharedLayerGraphs | None = None
        if config.first_kv_shared_layer is None:
            logger.info("YOCO fast prefill: n/a (no KV-shared layers)")
        elif self.yoco_layer is None:
            logger.info("YOCO fast prefill: off (%s=0)", YOCO_ENV)
        else:
            logger.info(
                "YOCO fast prefill: on (layers %d..%d run on logits rows only; %s=0 turns it off)",
                self.yoco_layer,
                config.num_layers - 1,
                YOCO_ENV,
            )

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, ple_dim]: (projection of the embedding + token's own PLE row) / sqrt(2)."""
        tokens = input_ids.shape[0]
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(tokens, self.config.num_layers, self.ple_dim))
        identity = self.embed_tokens_per_layer(input_ids).view(tokens, self.config.num_layers, self.ple_dim)
        return (projected + identity) * 2.0**-0.5

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scaled token embeddings and, on PLE checkpoints, the per-layer inputs of every layer."""
        hidden = self.embed_tokens(input_ids)
        return hidden, self.per_layer_inputs(input_ids, hidden) if self.ple_dim else None

    def run_layers(
        self,
        hidden: torch.Tensor,
        per_layer: torch.Tensor | None,
        batch: ForwardBatch,
        backend: AttentionBackend,
        layers: range,
    ) -> torch.Tensor:
        """Decoder layers `layers` over the batch's rows; attention metadata must be built for `batch`."""
        cos_sin = {t: self.rotary.cos_sin(batch.positions, t, hidden.dtype) for t in self.rotary.layer_types}
        attn_input = self.layers[layers[0]].input_layernorm(hidden) if len(layers) else None
        for i in layers:
            spec = self.config.layers[i]
            layer_input = per_layer[:, i] if per_layer is not None else None
            # each layer's last add also norms for the next layer's attention (one kernel, not two)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 in layers else None
            hidden, attn_input = self.layers[i](
                hidden, attn_input, layer_input, cos_sin[spec.layer_type], batch, backend, next_norm
            )
        return hidden

    def run_shared_layers(
        self, hidden: torch.Tensor, per_layer: torch.Tensor | None, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """YOCO's second part: the KV-shared layers and the final norm over logits rows only."""
        hidden = self.run_layers(hidden, per_layer, batch, backend, range(self.yoco_layer, len(self.layers)))
        return self.norm(hidden)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> TextModelOutput:
        """Final-norm hidden states of the batch's logits rows; attention metadata must be built for `batch`."""
        hidden, per_layer = self.embed(batch.input_ids)
        all_rows = len(batch.logits_rows_cpu) == batch.num_tokens
        if self.yoco_layer is None or all_rows:
            # with every row needed (decode, verify, all prompt logprobs) YOCO has nothing to save
            hidden = self.run_layers(hidden, per_layer, batch, backend, range(len(self.layers)))
            return TextModelOutput(self.norm(hidden if all_rows else hidden[batch.logits_rows]), 0)

        hidden = self.run_layers(hidden, per_layer, batch, backend, range(self.yoco_layer))
        rows = batch.logits_rows
        hidden = hidden[rows]
        per_layer = per_layer[rows] if per_layer is not None else None
        shared = batch.select_rows(batch.logits_rows_cpu)
        skipped = batch.num_tokens - shared.num_tokens
        if not shared.num_tokens:
            return TextModelOutput(hidden, skipped)  # an intermediate prefill chunk: no row needs the rest
        if self.shared_layer_graphs is not None and self.shared_layer_graphs.can_run(shared):
            return TextModelOutput(self.shared_layer_graphs(hidden, per_layer, shared), skipped)
        backend.init_forward_metadata(shared)
        return TextModelOutput(self.run_shared_layers(hidden, per_layer, shared, backend), skipped)

    def set_yoco(self, enabled: bool) -> None:
        """Run the KV-shared layers on logits rows only (when the checkpoint has any); for A/B runs."""
        self.yoco_layer = self.config.first_kv_shared_layer if enabled else None


class Gemma4ForCausalLM(nn.Module):
    """The text model plus the (tied) LM head with final logit softcapping."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma4TextModel(config)
        self.tie_word_embeddings = bool(config.hf_text_config.tie_word_embeddings)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def fuse_projections(self) -> None:
        """Stack projections that read the same input into one matmul each and store every projection weight
        transposed (`stack_linears`); call once, after loading weights."""
        for module in self.modules():
            if isinstance(module, (Gemma4Attention, Gemma4MLP)):
                module.fuse_projections()
        # the LM head too (cuBLAS: 482 -> 449 us at 32 rows); a tied embedding's lookup then gathers strided
        # columns, which costs little next to it
        store_transposed(self.model.embed_tokens if self.tie_word_embeddings else self.lm_head)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> LogitsOutput:
        backend.init_forward_metadata(batch)
        hidden, skipped = self.model(batch, backend)
        softcap = self.config.hf_text_config.final_logit_softcapping
        return LogitsOutput(compute_logits(hidden, self.lm_head_weight, softcap), hidden, skipped)
