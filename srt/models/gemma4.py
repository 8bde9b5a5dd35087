"""Gemma 4 text model over paged KV (E2B, E4B, 26B-A4B, 31B).

Numerically it follows transformers' modeling_gemma4.py; parameter names are the checkpoint's, so a Hugging
Face directory loads as it is. What differs is the execution: a flat batch of token rows (ForwardBatch),
KV written to the pools by each KV-owning layer's fused q/k/v kernel (`qkv_norm_rope_store`) and read through
an attention backend, KV-shared layers with no K/V weights reading their owner's buffers, and logits only for
the rows the caller needs. The decoder layer and its parts are in models/gemma4_layers.py.

YOCO fast prefill (E2B, E4B): the KV-shared layers write no KV, so nothing later reads their output at a row
whose logits nobody needs. Before the first of them the batch shrinks to its logits rows:

    layers 0 .. first_shared-1   every row (they write the KV every later row reads)
    gather logits_rows           hidden, per-layer inputs (made for these rows alone); ForwardBatch.select_rows
    layers first_shared .. end   logits rows only, each attending over its request's whole prefix
    final norm, LM head          logits rows

With one logits row per request (the usual prefill) the second part has the shape of a decode step, so on
GPU it replays a captured CUDA graph (`shared_layer_graphs`) instead of launching ~20 kernels per layer.

`GEMMA4_YOCO=0` (read when the model is built) runs every layer on every row instead, for A/B runs.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from srt import envs
from srt.configs.model_config import ModelConfig
from srt.forward.forward_batch import ForwardBatch
from srt.kernels.per_layer_inputs import combine_per_layer_inputs
from srt.layers.attention.base import AttentionBackend
from srt.layers.embedding import ScaledEmbedding
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import store_transposed
from srt.layers.logits_processor import LogitsOutput, compute_logits
from srt.layers.moe.router import Router
from srt.layers.rotary import RotaryEmbedding
from srt.models.gemma4_layers import Gemma4Attention, Gemma4DecoderLayer, Gemma4MLP
from srt.multimodal.inputs import ImageEmbeds

logger = logging.getLogger(__name__)

YOCO_ENV = envs.GEMMA4_YOCO.name


class SharedLayerRunner(Protocol):
    """Runs `Gemma4TextModel.run_shared_layers` faster for the batches it can take (the model executor's
    captured CUDA graphs)."""

    def can_run(self, batch: ForwardBatch) -> bool: ...

    def __call__(self, hidden: torch.Tensor, per_layer: torch.Tensor | None, batch: ForwardBatch) -> torch.Tensor: ...


class TextModelOutput(NamedTuple):
    hidden_states: torch.Tensor  # [logits rows, hidden] after the final norm
    yoco_skipped_rows: int  # rows the KV-shared layers did not run on (0 without YOCO)


class Gemma4TextModel(nn.Module):
    """Embeddings, per-layer inputs (PLE), decoder layers, final norm. Parameter prefix `model.`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_text_config
        self.config = config
        rank, size = config.tp_rank, config.tp_size
        self.embed_tokens = ScaledEmbedding(
            config.vocab_part(hf.vocab_size), hf.hidden_size, hf.hidden_size**0.5, rank, size
        )
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, spec) for spec in config.layers)
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf)
        self.ple_dim = hf.hidden_size_per_layer_input or 0
        if self.ple_dim:
            total = config.num_layers * self.ple_dim
            self.embed_tokens_per_layer = ScaledEmbedding(
                config.vocab_part(hf.vocab_size_per_layer_input), total, self.ple_dim**0.5, rank, size
            )
            self.per_layer_model_projection = nn.Linear(hf.hidden_size, total, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.ple_dim, hf.rms_norm_eps)
        # the layer at which the batch shrinks to its logits rows (YOCO); None runs every row through
        self.yoco_layer: int | None = None
        self.set_yoco(envs.GEMMA4_YOCO.enabled())
        # captured CUDA graphs of `run_shared_layers`, set by the ModelRunner when it captures them
        self.shared_layer_graphs: SharedLayerRunner | None = None
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

    def per_layer_inputs(
        self, input_ids: torch.Tensor, embeds: torch.Tensor, layers: int | None = None
    ) -> torch.Tensor:
        """[tokens, layers, ple_dim]: (normed projection of the embedding + token's own PLE row) / sqrt(2), of the
        first `layers` layers (None: every layer)."""
        table = self.embed_tokens_per_layer
        rows, ids = table.weight, input_ids
        if table.tp_size > 1:  # the rows of a vocab-parallel table, gathered: a table indexed by token position
            rows, ids = table.rows(input_ids), torch.arange(len(input_ids), device=input_ids.device)
        weight = self.per_layer_model_projection.weight
        if layers is not None:  # the layers' leading columns of the projection and the table
            width = layers * self.ple_dim
            weight, rows = weight[:width], rows[:, :width]
        return combine_per_layer_inputs(
            F.linear(embeds, weight),
            self.config.hidden_size**-0.5,
            self.per_layer_projection_norm.weight,
            self.per_layer_projection_norm.eps,
            rows,
            table.scale,
            ids,
        )

    def embed(self, input_ids: torch.Tensor, images: ImageEmbeds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled token embeddings, and the ids whose per-layer rows the per-layer inputs take.

        `images`: rows that take image embeddings. As in transformers, their per-layer inputs combine the pad
        token's per-layer row with the projection of the image embedding."""
        if images is not None:
            input_ids = input_ids.index_fill(0, images.rows, self.config.hf_text_config.pad_token_id)
        hidden = self.embed_tokens(input_ids)
        if images is not None:
            hidden = hidden.index_copy(0, images.rows, images.embeddings.to(hidden.dtype))
        return hidden, input_ids

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

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, images: ImageEmbeds | None = None
    ) -> TextModelOutput:
        """Final-norm hidden states of the batch's logits rows; attention metadata must be built for `batch`.
        `images`: the batch's image rows and their embeddings (multimodal checkpoints)."""
        hidden, ple_ids = self.embed(batch.input_ids, images)
        all_rows = batch.every_row_is_a_logits_row
        if self.yoco_layer is None or all_rows:
            # with every row needed (decode, verify, all prompt logprobs) YOCO has nothing to save
            per_layer = self.per_layer_inputs(ple_ids, hidden) if self.ple_dim else None
            hidden = self.run_layers(hidden, per_layer, batch, backend, range(len(self.layers)))
            return TextModelOutput(self.norm(hidden if all_rows else hidden[batch.logits_rows]), 0)

        rows = batch.logits_rows
        per_layer = shared_per_layer = None
        if self.ple_dim:
            # every row takes the first part's per-layer inputs, the logits rows alone the KV-shared layers'
            # (E4B: 18 of 42 layers' projection and table rows not made for an 8k prompt's other rows)
            if batch.logits_rows_cpu:
                shared_per_layer = self.per_layer_inputs(ple_ids[rows], hidden[rows])
            per_layer = self.per_layer_inputs(ple_ids, hidden, layers=self.yoco_layer)
        hidden = self.run_layers(hidden, per_layer, batch, backend, range(self.yoco_layer))
        hidden = hidden[rows]
        per_layer = shared_per_layer
        shared = batch.logits_batch()
        skipped = batch.num_tokens - shared.num_tokens
        if not shared.num_tokens:
            return TextModelOutput(hidden, skipped)  # an intermediate prefill chunk: no row needs the rest
        # a subset the caller laid out belongs to a captured step already (graphs do not nest)
        graphs = self.shared_layer_graphs if batch.logits_subset is None else None
        if graphs is not None and graphs.can_run(shared):
            return TextModelOutput(graphs(hidden, per_layer, shared), skipped)
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
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_part(config.vocab_size), bias=False)

    def fuse_projections(self) -> None:
        """Stack projections that read the same input into one matmul each and store every projection weight
        transposed (`stack_linears`); call once, after loading weights."""
        for module in self.modules():
            if isinstance(module, (Gemma4Attention, Gemma4MLP, Router)):
                module.fuse_projections()
        # the LM head too (cuBLAS: 482 -> 449 us at 32 rows); a tied embedding's lookup then gathers strided
        # columns (`kernels/embedding.py`), which costs little next to it
        store_transposed(self.model.embed_tokens if self.tie_word_embeddings else self.lm_head)
        if self.model.ple_dim:  # cuBLAS streams it faster so too (NN, not TN)
            store_transposed(self.model.per_layer_model_projection)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, images: ImageEmbeds | None = None
    ) -> LogitsOutput:
        backend.init_forward_metadata(batch)
        hidden, skipped = self.model(batch, backend, images)
        softcap = self.config.hf_text_config.final_logit_softcapping
        logits = compute_logits(hidden, self.lm_head_weight, softcap, self.config.tp_size, self.config.vocab_size)
        return LogitsOutput(logits.logits, hidden, skipped, logits.greedy_ids)
