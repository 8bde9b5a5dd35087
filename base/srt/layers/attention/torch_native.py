"""Reference attention backend: a loop over requests with torch's scaled_dot_product_attention.

Slow by design (one SDPA call per request and layer); it is the numerical reference the fast backends are
checked against, and the CPU path. FP8 KV is dequantized element by element (stored * scale) before SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt.configs.model_config import AttentionLayerSpec
from srt.forward.forward_batch import ForwardBatch
from srt.kernels.kv_quant import read_rows
from srt.layers.attention.base import AttentionBackend


@dataclass(frozen=True)
class _RequestRows:
    row_start: int  # first query row of the request in the batch
    num_rows: int
    req_pool_index: int
    seq_len: int  # tokens with KV (every query row sees at most these)
    min_position: int  # smallest query position: the sliding window's lower bound comes from it
    positions: torch.Tensor  # [num_rows] query positions
    # (first, end) positions of each image whose tokens attend to each other both ways (sliding layers only)
    image_spans: tuple[tuple[int, int], ...] = ()


class TorchNativeAttentionBackend(AttentionBackend):
    """Attention per request over KV gathered through req_to_token (and full_to_swa for sliding layers)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        positions_cpu = batch.positions.tolist()
        mm = batch.mm
        spans = mm.request_spans if mm is not None and mm.bidirectional else [[]] * batch.batch_size
        requests, row = [], 0
        for i, num_rows in enumerate(batch.extend_seq_lens_cpu):
            if num_rows:
                requests.append(
                    _RequestRows(
                        row_start=row,
                        num_rows=num_rows,
                        req_pool_index=int(batch.req_pool_indices[i]),
                        seq_len=batch.seq_lens_cpu[i],
                        min_position=min(positions_cpu[row : row + num_rows]),
                        positions=batch.positions[row : row + num_rows],
                        image_spans=tuple(spans[i]),
                    )
                )
            row += num_rows
        batch.attn_metadata = requests

    def forward(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        k_buffer, v_buffer = pool.kv_buffers(layer.layer_id)
        k_scale, v_scale = pool.kv_scales(layer.layer_id)  # the owner's, like the buffers (FP8 pools)
        req_to_token = batch.req_to_token_pool.req_to_token
        out = torch.empty_like(q)
        for req in batch.attn_metadata:
            # a sliding layer reads only positions some query row can still see; older SWA KV may be freed
            kv_start = 0
            if layer.sliding_window is not None:
                kv_start = max(0, req.min_position - layer.sliding_window + 1)
            full_slots = req_to_token[req.req_pool_index, kv_start : req.seq_len].to(torch.int64)
            rows = pool.layer_slots(layer.layer_id, full_slots)
            # [1, kv_heads, kv_len, head_dim] in q's dtype (FP8: dequantized, stored * scale)
            keys = read_rows(k_buffer, rows, k_scale, q.dtype).transpose(0, 1).unsqueeze(0)
            values = read_rows(v_buffer, rows, v_scale, q.dtype).transpose(0, 1).unsqueeze(0)
            kv_positions = torch.arange(kv_start, req.seq_len, device=q.device)
            q_positions = req.positions[:, None]
            mask = kv_positions[None, :] <= q_positions
            if layer.sliding_window is not None:
                for first, end in req.image_spans:  # transformers: AND(window, OR(causal, same image))
                    mask |= _inside(kv_positions[None, :], first, end) & _inside(q_positions, first, end)
                mask &= kv_positions[None, :] > q_positions - layer.sliding_window
            query = q[req.row_start : req.row_start + req.num_rows].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=1.0, enable_gqa=True)
            out[req.row_start : req.row_start + req.num_rows] = attended[0].transpose(0, 1)
        return out


def _inside(positions: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return (positions >= first) & (positions < end)
