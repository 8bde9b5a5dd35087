"""Gemma 4 MTP assistant (the drafter of frozen-KV multi-token prediction), over the target's paged KV.

Numerically it follows transformers' modeling_gemma4_assistant.py; parameter names are the checkpoint's, so a
Hugging Face `gemma4_assistant` directory loads as it is. One draft step of a batch, one row per request:

    target embedding of the last token ++ the target's (or last step's) hidden state   [rows, 2 * backbone]
    pre_projection -> decoder layers (every one KV-shared with the target) -> final norm  h  [rows, hidden]
    h -> LM head (centroid-masked on E2B/E4B) -> argmax             the next draft token
    h -> post_projection                                            the hidden state of the next step

The decoder layers are the target's `Gemma4DecoderLayer`s; their `AttentionLayerSpec`s (configs/
assistant_config.py) name target layers as KV owners, so the attention backends read the target's buffers
through `HybridKVPool` as for any KV-shared layer. Nothing here writes KV.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.configs.assistant_config import AssistantConfig
from srt.forward.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend
from srt.layers.embedding import ScaledEmbedding
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary import RotaryEmbedding
from srt.models.gemma4_layers import Gemma4Attention, Gemma4DecoderLayer, Gemma4MLP


class AssistantTextModel(nn.Module):
    """Token table (the tied LM head), KV-shared decoder layers, final norm. Parameter prefix `model.`."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        hf = config.text.hf_text_config
        self.config = config.text
        # the assistant never embeds tokens (it is fed the target's embedding): this table is its LM head
        self.embed_tokens = ScaledEmbedding(hf.vocab_size, hf.hidden_size, hf.hidden_size**0.5)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config.text, spec) for spec in config.layers)
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Final-norm hidden states of the batch's rows; attention metadata must be built for `batch`."""
        cos_sin = {t: self.rotary.cos_sin(batch.positions, t, hidden.dtype) for t in self.rotary.layer_types}
        attn_input = self.layers[0].input_layernorm(hidden)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            hidden, attn_input = layer(
                hidden, attn_input, None, cos_sin[layer.self_attn.spec.layer_type], batch, backend, next_norm
            )
        return self.norm(hidden)


class CentroidHead(nn.Module):
    """LM head over the tokens of the top-k centroids only (`use_ordered_embeddings`).

    The vocabulary is split into `num_centroids` clusters of vocab / num_centroids tokens; `token_ordering` lists
    the tokens cluster by cluster. Only the clusters with the k highest centroid scores get token logits, so
    the argmax is taken among k * vocab / num_centroids tokens instead of the whole vocabulary.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        if vocab_size % num_centroids:
            raise ValueError(f"vocab_size {vocab_size} is not a multiple of num_centroids {num_centroids}")
        self.num_centroids = num_centroids
        self.top_k = top_k
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab_size, dtype=torch.int64))

    def greedy_ids(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[rows] the highest-scoring token of each row among its top clusters' tokens."""
        top_clusters = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [rows, k]
        clusters = self.token_ordering.view(self.num_centroids, -1)
        candidates = clusters[top_clusters].flatten(1)  # [rows, k * tokens per cluster]
        logits = torch.einsum("rh,rch->rc", hidden, lm_head_weight[candidates])
        return candidates.gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)


class Gemma4AssistantForCausalLM(nn.Module):
    """The assistant: projections in and out of the target's hidden size around `AssistantTextModel`."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        hf = config.hf_config
        hidden, backbone = config.text.hidden_size, config.backbone_hidden_size
        self.config = config
        self.model = AssistantTextModel(config)
        self.pre_projection = nn.Linear(2 * backbone, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, backbone, bias=False)
        self.masked_embedding: CentroidHead | None = None
        if config.use_centroid_head:
            self.masked_embedding = CentroidHead(
                hidden, config.text.vocab_size, hf.num_centroids, hf.centroid_intermediate_top_k
            )

    def fuse_projections(self) -> None:
        """Stack and transpose the decoder's projections as the target's are; call once, after loading."""
        for module in self.modules():
            if isinstance(module, (Gemma4Attention, Gemma4MLP)):
                module.fuse_projections()

    @torch.no_grad()
    def step(
        self,
        token_embeds: torch.Tensor,
        backbone_hidden: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy draft step: (draft token ids [rows], hidden state [rows, backbone] for the next step).

        `token_embeds` is the target's embedding of each row's last token, `backbone_hidden` the target's
        final-norm hidden state there (or the previous step's output); attention metadata must be built for
        `batch` (one row per request at its frozen position)."""
        hidden = self.pre_projection(torch.cat([token_embeds, backbone_hidden.to(token_embeds.dtype)], dim=-1))
        hidden = self.model(hidden, batch, backend)
        lm_head_weight = self.model.embed_tokens.weight
        if self.masked_embedding is not None:
            ids = self.masked_embedding.greedy_ids(hidden, lm_head_weight)
        else:
            ids = (hidden @ lm_head_weight.t()).argmax(dim=-1)
        return ids, self.post_projection(hidden)
