"""CUDA graphs of the steps that run one row per request: decode, and YOCO's KV-shared layers after prefill.

Eager, a decode step launches ~20 kernels per layer and at small batches the host cannot launch them as
fast as the GPU runs them (E4B at batch 1: 45 ms/step eager, most of it launch overhead). Captured once per
batch size, a step is one graph replay.

A captured step reads its inputs from static buffers and writes its outputs to tensors kept alive between
replays; a batch of n rows replays the smallest captured size >= n, its rows n.. padded so that they touch
nothing real:

    input id 0, position 0, request row = req_to_token's padding row (all slot 0), seq_len 1,
    KV written to slot 0 (the allocators' padding slot, never handed out)

Padding rows attend over the padding slot only, and their outputs are dropped. The outputs of a replay are
views of the graph's own tensors: read them before the next forward.

Without graphs (`use_graphs=False`: CPU, or tests) the same padded step runs eagerly, so CPU tests cover the
padding and the static buffers.
"""

from __future__ import annotations

import torch

from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.forward.host_device import host_to_device
from srt.layers.attention.base import AttentionBackend
from srt.layers.logits_processor import LogitsOutput
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.model_executor.captured_steps import CapturedSteps, StaticInputs


class OneRowPerRequestSteps:
    """What both runners share: static per-row inputs, the captured steps, and the decode-shaped batch a step
    runs (one row per request, so the attention backends take their one-row-per-request path)."""

    def __init__(
        self,
        backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        batch_sizes: list[int],
        use_graphs: bool,
        extra_ids: dict[str, int] | None = None,
    ) -> None:
        """`extra_ids`: the subclass's own per-row ids and their padding values."""
        self.backend = backend
        self.req_to_token_pool, self.kv_pool = req_to_token_pool, kv_pool
        self.use_graphs = use_graphs
        ids = {"positions": 0, "req_pool_indices": req_to_token_pool.padding_row, "seq_lens": 1}
        self.inputs = StaticInputs(max(batch_sizes), kv_pool.device, ids | (extra_ids or {}))

    def _capture(self, batch_sizes: list[int], pool: tuple | None, name: str) -> None:
        """Call once every input is added: capturing reads them."""
        self.steps = CapturedSteps(self._step, batch_sizes, self.use_graphs, pool, name)

    def _step(self, batch_size: int) -> object:
        raise NotImplementedError

    def _run(self, values: dict[str, torch.Tensor | None], num_rows: int) -> object:
        """Load a batch's rows (padded to the next captured size) and run that size's step."""
        padded = self.steps.padded_size(num_rows)
        self.inputs.load(values, num_rows, padded)
        return self.steps.run(padded)

    def _batch(self, batch_size: int, input_ids: torch.Tensor, out_cache_loc: torch.Tensor) -> ForwardBatch:
        view = self.inputs.view(batch_size)
        # host lists describe the padded batch only in eager runs (CPU), read from the loaded inputs inside the
        # step; the captured kernels never read them, so the host reads nothing back before a replay
        seq_lens_cpu = view["seq_lens"].tolist() if not self.use_graphs else [1] * batch_size
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=view["positions"],
            req_pool_indices=view["req_pool_indices"],
            seq_lens=view["seq_lens"],
            extend_prefix_lens=view["positions"],  # a row at position p has p tokens before it
            extend_seq_lens=torch.ones_like(view["seq_lens"]),
            out_cache_loc=out_cache_loc,
            logits_rows=torch.arange(batch_size, device=self.inputs.device),
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=[n - 1 for n in seq_lens_cpu],
            extend_seq_lens_cpu=[1] * batch_size,
            logits_rows_cpu=list(range(batch_size)),
        )


class DecodeGraphs(OneRowPerRequestSteps):
    """The whole model's decode step (logits included), captured per batch size."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        batch_sizes: list[int],
        use_graphs: bool,
        pool: tuple | None = None,
    ) -> None:
        ids = {"input_ids": 0, "out_cache_loc": 0}
        super().__init__(backend, req_to_token_pool, kv_pool, batch_sizes, use_graphs, ids)
        self.model = model
        self._capture(batch_sizes, pool, "decode")

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode == ForwardMode.DECODE
            and batch.num_tokens == batch.batch_size
            and 0 < batch.batch_size <= self.steps.max_batch_size
        )

    def __call__(self, batch: ForwardBatch) -> LogitsOutput:
        """Logits of every row of a decode batch; KV of its tokens is written to the pools."""
        values = {name: getattr(batch, name) for name in self.inputs.names}
        out = self._run(values, batch.batch_size)
        rows = batch.batch_size
        greedy_ids = None if out.greedy_ids is None else out.greedy_ids[:rows]
        return LogitsOutput(out.logits[:rows], out.hidden_states[:rows], 0, greedy_ids)

    def _step(self, batch_size: int) -> LogitsOutput:
        view = self.inputs.view(batch_size)
        return self.model(self._batch(batch_size, view["input_ids"], view["out_cache_loc"]), self.backend)


class SharedLayerGraphs(OneRowPerRequestSteps):
    """YOCO's second part (`Gemma4TextModel.run_shared_layers`) for one logits row per request, per row count.

    The KV-shared layers write no KV, so their inputs are the rows' hidden states and per-layer inputs plus
    what attention needs: each row's position, request row and sequence length.
    """

    def __init__(
        self,
        text_model: torch.nn.Module,
        backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
        batch_sizes: list[int],
        use_graphs: bool,
        pool: tuple | None = None,
    ) -> None:
        super().__init__(backend, req_to_token_pool, kv_pool, batch_sizes, use_graphs)
        self.text_model = text_model
        dtype = text_model.embed_tokens.weight.dtype
        self.inputs.add("hidden", (text_model.config.hidden_size,), dtype, 0.0)
        if text_model.ple_dim:
            self.inputs.add("per_layer", (text_model.config.num_layers, text_model.ple_dim), dtype, 0.0)
        self._capture(batch_sizes, pool, "the KV-shared layers")

    def can_run(self, batch: ForwardBatch) -> bool:
        """`batch` is a YOCO row subset: it fits when every request has at most one row."""
        return 0 < batch.num_tokens <= self.steps.max_batch_size and max(batch.extend_seq_lens_cpu) <= 1

    def __call__(self, hidden: torch.Tensor, per_layer: torch.Tensor | None, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states of the rows of `batch` (each request's only row, if it has one)."""
        with_rows = [i for i, n in enumerate(batch.extend_seq_lens_cpu) if n]
        req_pool_indices, seq_lens = batch.req_pool_indices, batch.seq_lens
        if len(with_rows) < batch.batch_size:  # requests whose chunk needs no logits have no row here
            (index,) = host_to_device([with_rows], seq_lens.device)  # pinned: no wait for the device
            req_pool_indices, seq_lens = req_pool_indices[index], seq_lens[index]
        values = {
            "hidden": hidden,
            "per_layer": per_layer,
            "positions": batch.positions,
            "req_pool_indices": req_pool_indices,
            "seq_lens": seq_lens,
        }
        return self._run(values, batch.num_tokens)[: batch.num_tokens]

    @torch.no_grad()
    def _step(self, batch_size: int) -> torch.Tensor:
        view = self.inputs.view(batch_size)
        positions = view["positions"]
        # input ids and KV slots are unused: the shared layers start from hidden states and write no KV
        batch = self._batch(batch_size, positions, torch.zeros_like(positions))
        self.backend.init_forward_metadata(batch)
        return self.text_model.run_shared_layers(view["hidden"], view.get("per_layer"), batch, self.backend)
