"""Owns the model weights, the KV pools and the attention backend; runs one ForwardBatch at a time."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import GenerationConfig

from srt.configs.model_config import ModelConfig, resolve_dtype
from srt.distributed.ranks import TensorParallelGroup
from srt.forward.forward_batch import ForwardBatch
from srt.kernels.kv_quant import is_fp8_kv
from srt.layers.attention import create_attention_backend
from srt.layers.logits_processor import LogitsOutput
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.kv_cache_dtype import KVScales, resolve_kv_cache_dtype
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.memory_plan import MemoryPlan, plan_memory
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.model_executor.captured_steps import default_batch_sizes
from srt.model_executor.cuda_graph_runner import DecodeGraphs, SharedLayerGraphs
from srt.model_executor.draft_graphs import DraftGraphs
from srt.model_executor.extend_graphs import ExtendGraphs, default_token_counts
from srt.model_loader.kv_scales import read_kv_scales
from srt.model_loader.loader import load_model, safetensors_files
from srt.models.gemma4_mm import Gemma4ForConditionalGeneration
from srt.server_args import ServerArgs
from srt.speculative.assistant_loader import load_assistant
from srt.speculative.frozen_kv_mtp import DraftRequests, FrozenKVDrafter

logger = logging.getLogger(__name__)

# Without a GPU to size from, CPU runs get this many full-pool tokens unless --max-total-tokens says otherwise.
CPU_DEFAULT_TOTAL_TOKENS = 16384


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_load_format(server_args: ServerArgs) -> str:
    if server_args.load_format != "auto":
        return server_args.load_format
    return "safetensors"


class ModelRunner:
    """The model on its device with its KV memory; under tensor parallelism (`tp`) this rank's shard of both."""

    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig | None = None,
        tp: TensorParallelGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`device`: where a one-rank replica runs (default: the rank's under `tp`, else --device)."""
        self.server_args = server_args
        self.tp = tp
        self.device = tp.device if tp is not None else device or resolve_device(server_args.device)
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        self.model_config = model_config or ModelConfig.from_name_or_path(server_args.model_path)
        whole_model_config = self.model_config
        if tp is not None:
            self.model_config = self.model_config.for_tensor_parallel(tp.place.rank, tp.place.size)
        load_format = resolve_load_format(server_args)
        model_path = Path(server_args.model_path) if load_format != "dummy" else None
        self.model = load_model(
            self.model_config,
            model_path,
            load_format,
            self.dtype,
            self.device,
            seed=server_args.seed,
            quantization=server_args.quantization,
            dequantize_fp8=server_args.dequantize_fp8_weights,
        )
        if isinstance(self.model, Gemma4ForConditionalGeneration):
            self.model.configure_encoder(
                server_args.mm_encoder_budget_mb << 20,
                server_args.mm_embedding_cache_tokens,
                batched=not server_args.disable_batched_mm_encoder,
            )
        # the MTP assistant (--speculative-draft-model-path): checked against the target before pools are sized
        self.drafter: FrozenKVDrafter | None = None
        if server_args.speculative_algorithm == "FROZEN_KV_MTP":
            assistant = load_assistant(
                server_args.speculative_draft_model_path,
                whole_model_config,
                load_format,
                self.dtype,
                self.device,
                seed=server_args.seed,
                tp_rank=tp.place.rank if tp is not None else 0,
                tp_size=tp.place.size if tp is not None else 1,
            )
            self.drafter = FrozenKVDrafter(assistant, self.model, server_args.speculative_num_steps)
        self.kv_dtype = resolve_kv_cache_dtype(server_args.kv_cache_dtype, self.dtype)
        self.context_len = server_args.context_length or self.model_config.context_len
        self.eos_token_ids = checkpoint_eos_token_ids(self.model_config, server_args.model_path)
        full_tokens, swa_tokens = self._pool_sizes()
        self.req_to_token_pool = ReqToTokenPool(
            server_args.max_running_requests, min(self.context_len, full_tokens) + 1, self.device
        )
        self.token_allocator = SWATokenAllocator(full_tokens, swa_tokens, self.device)
        # the assistant's layers join the pool's ownership map as readers of the target's KV-owning layers
        draft_layers = self.drafter.assistant.config.layers if self.drafter else ()
        self.kv_pool = HybridKVPool(
            self.model_config.layers + draft_layers,
            self.token_allocator,
            self.kv_dtype,
            self.device,
            self._kv_scales(model_path),
        )
        backend = server_args.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch_native"
        self.attn_backend = create_attention_backend(backend)
        # rows the KV-shared layers did not run on, over every forward so far (YOCO fast prefill; /metrics)
        self.yoco_rows_skipped_total = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        self.verify_graphs: ExtendGraphs | None = None  # MTP verify steps: K + 1 rows per request
        self.draft_graphs: DraftGraphs | None = None
        if self.device.type == "cuda" and backend == "triton" and not server_args.disable_cuda_graph:
            self.capture_cuda_graphs()
        logger.info(
            "model ready: %s on %s (%s), KV pools (%s): full %d tokens, swa %d tokens, attention %s",
            server_args.model_path,
            self.device,
            self.dtype,
            self.kv_dtype,
            full_tokens,
            swa_tokens,
            backend,
        )

    def _kv_scales(self, model_path: Path | None) -> dict[int, KVScales]:
        """FP8 KV: the checkpoint's per-layer K/V scales where it has them (dummy weights: none, so 1.0)."""
        if not is_fp8_kv(self.kv_dtype) or model_path is None:
            return {}
        owners = {spec.layer_id for spec in self.model_config.layers if spec.owns_kv}
        return read_kv_scales(safetensors_files(model_path), owners)

    def _pool_sizes(self) -> tuple[int, int]:
        """(full, swa) pool tokens: --max-total-tokens, else --mem-fraction-static of the GPU's memory."""
        models = [self.model, *([self.drafter.assistant] if self.drafter else [])]
        weight_bytes = sum(t.numel() * t.element_size() for m in models for t in m.state_dict().values())
        device_memory = None
        if self.device.type == "cuda":
            device_memory = torch.cuda.get_device_properties(self.device).total_memory
        plan = plan_pools(self.server_args, self.model_config, self.dtype, weight_bytes, device_memory, self.kv_dtype)
        rank = f"rank {self.tp.place.rank}: " if self.tp is not None else ""
        logger.info("KV memory: %s%s", rank, plan.summary())
        self.memory_plan = plan
        if self.tp is not None:  # every rank allocates the same slots: the smallest pools of any rank
            return tuple(self.tp.agree_min([plan.full_tokens, plan.swa_tokens]))
        return plan.full_tokens, plan.swa_tokens

    def capture_cuda_graphs(self, use_graphs: bool = True) -> None:
        """Capture steps of up to --cuda-graph-max-tokens tokens (and of that many beside a decode row of every
        running request) per token count, decode steps and YOCO's KV-shared layers per batch size
        (`use_graphs=False`: run the same padded steps eagerly, which is how CPU tests cover them)."""
        args = self.server_args
        max_bs = min(args.cuda_graph_max_bs or args.max_running_requests, args.max_running_requests)
        batch_sizes = default_batch_sizes(max_bs)
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        pools = (self.req_to_token_pool, self.kv_pool)
        # a speculating request's item in a step has K + 1 logits rows (its newest token and K drafts)
        rows = self.drafter.num_steps + 1 if self.drafter is not None else 1
        if args.cuda_graph_max_tokens:
            # first: the largest activations, whose memory the smaller graphs then share
            token_counts = default_token_counts(args.cuda_graph_max_tokens, args.max_running_requests)
            self.extend_graphs = ExtendGraphs(
                self.model, self.attn_backend, *pools, token_counts, args.max_running_requests, use_graphs, pool,
                logits_per_request=rows,
            )  # fmt: skip
        self.decode_graphs = DecodeGraphs(self.model, self.attn_backend, *pools, batch_sizes, use_graphs, pool)
        if self.drafter is not None:
            self.draft_graphs = DraftGraphs(self.drafter, self.attn_backend, *pools, batch_sizes, use_graphs, pool)
            # verify steps of up to max_bs requests, every token a logits row (R = tokens); their logits go to the
            # token-count graphs' buffer (never replayed at the same time)
            shared = self.extend_graphs.logits_out if self.extend_graphs is not None else None
            self.verify_graphs = ExtendGraphs(
                self.model, self.attn_backend, *pools, [rows * size for size in batch_sizes], rows * max_bs,
                use_graphs, pool, attend_row_by_row=True, logits_out=shared,
            )  # fmt: skip
        text_model = self.model.model
        if text_model.yoco_layer is not None:
            text_model.shared_layer_graphs = SharedLayerGraphs(
                text_model, self.attn_backend, *pools, batch_sizes, use_graphs, pool
            )

    def draft(self, requests: DraftRequests) -> torch.Tensor:
        """[batch, K] MTP draft tokens (FROZEN_KV_MTP); the drafter reads the target's KV, writes none."""
        if self.draft_graphs is not None and self.draft_graphs.can_run(len(requests.kv_lens)):
            return self._rank_0s(self.draft_graphs(requests))
        return self._rank_0s(self.drafter.draft(requests, self.req_to_token_pool, self.kv_pool, self.attn_backend))

    def _rank_0s(self, drafts: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism, rank 0's drafts on every rank. The assistant's argmax runs on each rank's own
        hidden state, which rounding may leave a last bit apart (the vision tower's atomic pooling), and a near
        tie decided differently would verify different drafts and desynchronise the ranks' KV lengths."""
        if self.tp is not None:
            torch.distributed.broadcast(drafts, src=0)
        return drafts

    def draft_ahead(
        self, newest: torch.Tensor, hidden: torch.Tensor, kv_lens: torch.Tensor, row_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """Drafts of the next round from device state (the overlap of a draft round with the host's bookkeeping
        of the verify step before it; `row_ids`: the requests' req_to_token rows); None without draft graphs (not
        captured) or past their largest batch."""
        graphs = self.draft_graphs
        if graphs is None or not graphs.can_run(len(row_ids)):
            return None
        return self._rank_0s(graphs.on_device(newest, hidden, kv_lens, row_ids))

    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Logits of `batch.logits_rows`; KV of the batch's new tokens is written to the pools.

        The output of a CUDA-graph replay lives in the graph's buffers: read it before the next forward.
        """
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs(batch)
        # a batch with image rows runs eagerly: its embeddings come from the vision tower, outside any graph
        # verify steps (rows attending one by one) replay their own graphs; prompts keep the token-count ones
        verify = batch.attend_row_by_row and self.verify_graphs is not None
        if batch.mm is None and verify and self.verify_graphs.can_run(batch):
            output = self.verify_graphs(batch)
        elif batch.mm is None and self.extend_graphs is not None and self.extend_graphs.can_run(batch):
            output = self.extend_graphs(batch)
        else:
            output = self.model(batch, self.attn_backend)
        if output.yoco_skipped_rows:
            self.yoco_rows_skipped_total += output.yoco_skipped_rows
            logger.debug(
                "YOCO: KV-shared layers skipped %d of %d rows (%d in total)",
                output.yoco_skipped_rows,
                batch.num_tokens,
                self.yoco_rows_skipped_total,
            )
        return output


def plan_pools(
    server_args: ServerArgs,
    model_config: ModelConfig,
    dtype: torch.dtype,
    weight_bytes: int,
    device_memory_bytes: int | None,
    kv_dtype: torch.dtype | None = None,
) -> MemoryPlan:
    """The KV pools a runner gets: --max-total-tokens, else --mem-fraction-static of the device's memory; with no
    device memory to size from (the CPU) and no --max-total-tokens, CPU_DEFAULT_TOTAL_TOKENS full-pool tokens.
    `kv_dtype`: the pools' elements (default: what --kv-cache-dtype makes of `dtype`)."""
    max_total_tokens = server_args.max_total_tokens
    if device_memory_bytes is None and max_total_tokens is None:
        max_total_tokens = CPU_DEFAULT_TOTAL_TOKENS
    return plan_memory(
        model_config,
        dtype,
        weight_bytes,
        device_memory_bytes=device_memory_bytes,
        mem_fraction_static=server_args.mem_fraction_static,
        max_total_tokens=max_total_tokens,
        swa_full_tokens_ratio=server_args.swa_full_tokens_ratio,
        kv_dtype=kv_dtype or resolve_kv_cache_dtype(server_args.kv_cache_dtype, dtype),
    )


def checkpoint_eos_token_ids(model_config: ModelConfig, model_path: str) -> list[int]:
    """EOS ids of the config and of generation_config.json (Gemma's end-of-turn token is only there)."""
    ids = set(model_config.eos_token_ids)
    path = Path(model_path)
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)
