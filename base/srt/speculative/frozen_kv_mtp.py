"""Frozen-KV MTP drafting: K greedy assistant steps for every request of a batch at once.

A round starts where the target left a request: its newest token t0 at position p = kv_len, sampled from the
target's row at p - 1 and without KV yet. The assistant runs at position p and attends over the target's KV
0 .. p-1; it writes no KV, so every step of a round sees the same KV and the same position ("frozen"). The
attention metadata is therefore built once per round and the K steps run without reading anything back:

    round input   newest token t0, the target's final-norm hidden state h0 of the row that sampled it, kv_len
    step 1        assistant(embed_target(t0), h0) -> d1, h1
    step k        assistant(embed_target(d_{k-1}), h_{k-1}) -> d_k, h_k          (position stays p)
    output        [d1 .. dK]: guesses of the tokens at p + 1 .. p + K

Verification, acceptance and KV rollback are the scheduler's (later parts of issue #23).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from srt.configs.assistant_config import DRAFT_EXTRA_SWA_TOKENS
from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.base import AttentionBackend
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.models.gemma4 import Gemma4ForCausalLM
from srt.models.gemma4_assistant import Gemma4AssistantForCausalLM

MIN_DRAFT_STEPS, MAX_DRAFT_STEPS = 1, 16


class DraftRequests(NamedTuple):
    """The state a round drafts from, one entry per request."""

    last_token_ids: torch.Tensor  # [batch] the newest token (no KV yet), on the device
    backbone_hidden: torch.Tensor  # [batch, target hidden] the target's final-norm hidden state that sampled it
    kv_lens: list[int]  # tokens with KV: the newest token's position
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
        # sliding-window KV positions it reads beyond the target's next query: the scheduler keeps them
        self.extra_swa_tokens = DRAFT_EXTRA_SWA_TOKENS

    @torch.no_grad()
    def draft(
        self,
        requests: DraftRequests,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """[batch, num_steps] draft token ids; reads the target's KV through `kv_pool`, writes none."""
        batch_size = len(requests.kv_lens)
        if min(requests.kv_lens, default=1) < 1:
            raise ValueError(f"every request needs KV to draft from; kv_lens {requests.kv_lens}")
        device = kv_pool.device
        # one row per request reading KV 0 .. kv_len-1: laid out as a decode row at kv_len - 1 (whose KV is
        # there), then moved to its own position; slot 0 (padding) as the never-written KV slot
        batch = ForwardBatch.build(
            mode=ForwardMode.DECODE,
            new_token_ids=requests.last_token_ids,
            prefix_lens=[kv_len - 1 for kv_len in requests.kv_lens],
            req_pool_indices=requests.req_pool_indices,
            out_cache_loc=torch.zeros(batch_size, dtype=torch.int64, device=device),
            logits_rows=list(range(batch_size)),
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
        )
        batch.positions += 1
        return self.draft_batch(batch, requests.backbone_hidden, backend)

    @torch.no_grad()
    def draft_batch(
        self, batch: ForwardBatch, backbone_hidden: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """The K steps over a laid-out batch: one decode-shaped row per request at its newest token's position
        p, reading KV 0 .. p-1 (seq_len p); `batch.input_ids` are the newest tokens. A CUDA graph captures it."""
        backend.init_forward_metadata(batch)  # once: positions and KV lengths are frozen for the round
        token_ids, hidden = batch.input_ids, backbone_hidden
        drafts = []
        for _ in range(self.num_steps):
            token_ids, hidden = self.assistant.step(self.target_embedding(token_ids), hidden, batch, backend)
            drafts.append(token_ids)
        return torch.stack(drafts, dim=1)
