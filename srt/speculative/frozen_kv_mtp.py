"""Frozen-KV MTP drafting: K greedy assistant steps for every request of a batch at once.

The assistant runs at each request's last accepted position and attends over the target's KV up to it; it
writes no KV, so every step of a round sees the same KV and the same positions ("frozen"). The attention
metadata is therefore built once per round and the K steps run without reading anything back to the host:

    round input   last accepted token t0, target's final-norm hidden state h0 at t0, seq_len (t0 included)
    step 1        assistant(embed_target(t0), h0) -> d1, h1
    step k        assistant(embed_target(d_{k-1}), h_{k-1}) -> d_k, h_k          (position stays seq_len - 1)
    output        [d1 .. dK]

Verification, acceptance and KV rollback are the scheduler's (later parts of issue #23).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.base import AttentionBackend
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.models.gemma4 import Gemma4ForCausalLM
from srt.models.gemma4_assistant import Gemma4AssistantForCausalLM

MIN_DRAFT_STEPS, MAX_DRAFT_STEPS = 1, 16


class DraftRequests(NamedTuple):
    """The state a round drafts from, one entry per request."""

    last_token_ids: torch.Tensor  # [batch] the last accepted token (its KV is in the pools), on the device
    backbone_hidden: torch.Tensor  # [batch, target hidden] the target's final-norm hidden state at that token
    seq_lens: list[int]  # tokens with KV, the last accepted one included
    req_pool_indices: list[int]  # req_to_token rows


class FrozenKVDrafter:
    """The assistant and the target's token embedding; `draft` returns [batch, num_steps] greedy draft ids."""

    def __init__(self, assistant: Gemma4AssistantForCausalLM, target: Gemma4ForCausalLM, num_steps: int) -> None:
        if not MIN_DRAFT_STEPS <= num_steps <= MAX_DRAFT_STEPS:
            raise ValueError(
                f"speculative_num_steps must be in [{MIN_DRAFT_STEPS}, {MAX_DRAFT_STEPS}]; got {num_steps}"
            )
        self.assistant = assistant
        self.target_embedding = target.model.embed_tokens
        self.num_steps = num_steps

    @torch.no_grad()
    def draft(
        self,
        requests: DraftRequests,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """[batch, num_steps] draft token ids; reads the target's KV through `kv_pool`, writes none."""
        batch_size = len(requests.seq_lens)
        if min(requests.seq_lens, default=1) < 1:
            raise ValueError(f"every request needs its last accepted token in KV; seq_lens {requests.seq_lens}")
        device = kv_pool.device
        # one row per request at its last accepted position; slot 0 (padding) as the never-written KV slot
        batch = ForwardBatch.build(
            mode=ForwardMode.DECODE,
            new_token_ids=requests.last_token_ids,
            prefix_lens=[seq_len - 1 for seq_len in requests.seq_lens],
            req_pool_indices=requests.req_pool_indices,
            out_cache_loc=torch.zeros(batch_size, dtype=torch.int64, device=device),
            logits_rows=list(range(batch_size)),
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
        )
        backend.init_forward_metadata(batch)  # once: positions and KV lengths are frozen for the round
        token_ids, hidden = batch.input_ids, requests.backbone_hidden
        drafts = []
        for _ in range(self.num_steps):
            token_ids, hidden = self.assistant.step(self.target_embedding(token_ids), hidden, batch, backend)
            drafts.append(token_ids)
        return torch.stack(drafts, dim=1)
