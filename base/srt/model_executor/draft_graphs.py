"""CUDA graphs of an MTP draft round (FROZEN_KV_MTP): the assistant's K steps for a batch, per batch size.

Eagerly a round is K small forwards of a few layers each, launch-bound; captured, it is one replay whose K steps
never return to the host (each step's argmax feeds the next on the device). A round's inputs are one row per
request, padded as decode rows are (`cuda_graph_runner.py`):

    input id   the newest token             padding: 0
    hidden     the target's hidden state    padding: 0
    position   kv_len, seq_len kv_len       padding: position 0, seq_len 1, the padding row (slot 0)
"""

from __future__ import annotations

import torch

from srt.forward.host_device import host_to_device
from srt.layers.attention.base import AttentionBackend
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.model_executor.cuda_graph_runner import OneRowPerRequestSteps
from srt.speculative.frozen_kv_mtp import DraftRequests, FrozenKVDrafter


class DraftGraphs(OneRowPerRequestSteps):
    """`FrozenKVDrafter.draft_batch` captured per batch size."""

    def __init__(
        self,
        drafter: FrozenKVDrafter,
        backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        batch_sizes: list[int],
        use_graphs: bool,
        pool: tuple | None = None,
    ) -> None:
        super().__init__(backend, req_to_token_pool, kv_pool, batch_sizes, use_graphs, {"input_ids": 0})
        self.drafter = drafter
        hidden_size = drafter.assistant.config.backbone_hidden_size
        self.inputs.add("hidden", (hidden_size,), drafter.target_embedding.weight.dtype, 0.0)
        self._capture(batch_sizes, pool, "MTP draft rounds")

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.steps.max_batch_size

    def __call__(self, requests: DraftRequests) -> torch.Tensor:
        """[batch, K] drafts, as `FrozenKVDrafter.draft` gives them."""
        kv_lens, rows = host_to_device([requests.kv_lens, requests.req_pool_indices], self.inputs.device)
        return self.on_device(requests.last_token_ids, requests.backbone_hidden, kv_lens, rows)

    def on_device(
        self, newest: torch.Tensor, hidden: torch.Tensor, kv_lens: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Drafts from device tensors (a round launched before the host read the last one's counts)."""
        batch_size = len(rows)
        values = {
            "positions": kv_lens,
            "req_pool_indices": rows,
            "seq_lens": kv_lens,
            "input_ids": newest,
            "hidden": hidden,
        }
        # a copy: the replay's output buffer lies in the graphs' shared memory pool, which the verify step's replay
        # reuses before acceptance reads these drafts (sampled requests index probabilities with them)
        return self._run(values, batch_size)[:batch_size].clone()

    def _step(self, batch_size: int) -> torch.Tensor:
        view = self.inputs.view(batch_size)
        batch = self._batch(batch_size, view["input_ids"], torch.zeros_like(view["input_ids"]))
        return self.drafter.draft_batch(batch, view["hidden"], self.backend)
