"""The `triton` attention backend (GPU default): Triton kernels over the req_to_token indirection.

Same semantics as `torch_native`: each query row sees its request's KV positions up to its own position
(and, on sliding layers, no further back than window - 1); sliding layers read the SWA pool through
`full_to_swa`; KV-shared layers read their owner's buffers (and, FP8 pools, its scales). Three kernels:

- decode (`kernels/attention/decode.py`): one query row at a time, split-KV with a combine pass. Used for
  DECODE batches (row i = request i; nothing is read back to the host, so it can run under CUDA graphs) and for
  extend batches whose requests have at most one row each (e.g. YOCO's last-row subsets).
- verify (`kernels/attention/verify.py`): split-KV as decode, a request's rows together over the KV they share,
  for batches with `verify_rows` set (speculative verify steps: a few rows per request over a long prefix,
  where the extend kernel would give each request's tile a single program walking the whole prefix, and the
  decode kernel would read the prefix once per row). Verify steps of fewer than VERIFY_KERNEL_MIN_REQUESTS
  requests run the decode kernel row by row instead, each row up to its own position.
- extend (`kernels/attention/extend.py`): tiles of rows per request, for everything else. In a step that
  mixes requests of one row (decoding requests) with requests of several (prompt chunks), the one-row
  requests go to the decode kernel and only the others get tiles: a one-row request's tile would compute
  BLOCK_Q x heads rows of scores over its whole KV for one real row (E4B on an H100, steps of one 8k prompt
  beside 31 decoding requests of up to 8k context: 88.9 -> 86.6 ms, two serving runs).

Per-forward metadata is a handful of device tensors made once in `init_forward_metadata` (plus tile tables
and scratch made at the first layer of each shape and reused by the rest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch
import triton

from srt.configs.model_config import AttentionLayerSpec
from srt.forward.forward_batch import ForwardBatch
from srt.forward.host_device import host_to_device
from srt.kernels.attention.decode import decode_attention, decode_partials, default_decode_config, num_kv_splits
from srt.kernels.attention.extend import (
    build_extend_tiles,
    build_extend_tiles_host,
    default_extend_config,
    extend_attention,
)
from srt.kernels.attention.verify import verify_attention, verify_tile_rows
from srt.kernels.kv_quant import is_fp8_kv
from srt.layers.attention.base import AttentionBackend
from srt.mem_cache.allocator import check_indices, debug_kv_indices

# Without a GPU (the Triton CPU interpreter in tests) pretend to have this many multiprocessors, so that
# decode still splits the KV of a few short requests.
INTERPRETER_NUM_SMS = 16
# Verify steps of fewer requests than this attend row by row with the decode kernel. H100, E4B, K = 3, 512-token
# contexts (docs/benchmarks.md): at batch 32 the verify kernel took a verify step from 7.70-7.90 to 7.13-7.19 ms,
# at batch 1 from 4.52-4.57 to 4.66-4.88 ms (its grid's programs for tiles without rows cost more than the reads it
# saves). Batches between were not measured: 8 is an estimate of where the saved reads start to win.
VERIFY_KERNEL_MIN_REQUESTS = 8


@cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


@dataclass
class TritonAttentionMetadata:
    """Device tensors of one forward. Decode-kernel rows: `row_*` (one entry per query row)."""

    use_decode_kernel: bool
    positions: torch.Tensor  # [rows]
    # verify kernel (and its tile tables): the most rows a request has (`ForwardBatch.verify_rows`), 0 if unused
    verify_rows: int = 0
    # decode kernel: the request of each row
    row_pool_indices: torch.Tensor | None = None
    row_seq_lens: torch.Tensor | None = None
    # extend kernel: per request
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    # extend kernel, sliding layers: each row's last visible kv position where image rows see their whole image
    last_visible: torch.Tensor | None = None
    # extend kernel beside the decode kernel (a mixed step): the requests of one row, which get no tile and
    # whose rows (`one_row`: the decode kernel's metadata, positions those rows') the decode kernel computes
    one_row_requests: list[bool] | None = None  # per request, on the host
    one_row: TritonAttentionMetadata | None = None
    one_row_index: torch.Tensor | None = None  # [one-row rows] their rows in the batch
    # made at the first layer that needs them, reused by the others
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # block_q -> tile table
    partials: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class TritonAttentionBackend(AttentionBackend):
    """Paged-KV attention with Triton kernels; the default on CUDA devices."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # verify rows come after every image of their request: no image rows to see ahead
        if batch.verify_rows and batch.num_tokens >= VERIFY_KERNEL_MIN_REQUESTS * batch.verify_rows:
            batch.attn_metadata = TritonAttentionMetadata(
                use_decode_kernel=False,
                positions=batch.positions,
                verify_rows=batch.verify_rows,
                req_pool_indices=batch.req_pool_indices,
                seq_lens=batch.seq_lens,
                extend_seq_lens=batch.extend_seq_lens,
            )
            return
        if batch.verify_rows:
            # each row alone: its request the first whose cumulative token count passes it (a search, not
            # repeat_interleave, which asserts the counts sum to the tokens: a graph is captured on padding)
            ends = batch.extend_seq_lens.cumsum(0)
            tokens = torch.arange(batch.num_tokens, device=ends.device)
            owner = torch.searchsorted(ends, tokens, right=True).clamp_(max=len(ends) - 1)
            batch.attn_metadata = TritonAttentionMetadata(
                use_decode_kernel=True,
                positions=batch.positions,
                row_pool_indices=batch.req_pool_indices[owner],
                row_seq_lens=batch.positions + 1,  # keys 0 .. its position
            )
            return
        if batch.mode.is_decode() and batch.positions.shape[0] == batch.seq_lens.shape[0]:
            # one row per request, in request order: the batch's tensors are the per-row arrays already
            batch.attn_metadata = TritonAttentionMetadata(
                use_decode_kernel=True,
                positions=batch.positions,
                row_pool_indices=batch.req_pool_indices,
                row_seq_lens=batch.seq_lens,
            )
            return
        last_visible = _image_last_visible(batch)
        if last_visible is None and batch.extend_seq_lens_cpu and max(batch.extend_seq_lens_cpu) <= 1:
            # at most one row per request (host lists, no read-back): the split-KV kernel, one row each
            rows_of = [i for i, n in enumerate(batch.extend_seq_lens_cpu) if n]
            (index,) = host_to_device([rows_of], batch.seq_lens.device)  # pinned: no wait for the device
            batch.attn_metadata = _decode_rows(batch, index, batch.positions)
            return
        meta = TritonAttentionMetadata(
            use_decode_kernel=False,
            positions=batch.positions,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            extend_seq_lens=batch.extend_seq_lens,
            last_visible=last_visible,
        )
        lens = batch.extend_seq_lens_cpu
        if last_visible is None and 1 in lens and max(lens) > 1:
            _split_one_row_requests(meta, batch)
        batch.attn_metadata = meta

    def forward(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        k_buffer, v_buffer = pool.kv_buffers(layer.layer_id)
        k_scale, v_scale = pool.kv_scales(layer.layer_id)  # the owner's, like the buffers (FP8 pools)
        req_to_token = batch.req_to_token_pool.req_to_token
        full_to_swa = pool.allocator.full_to_swa
        meta: TritonAttentionMetadata = batch.attn_metadata
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_rows, num_heads, head_dim = q.shape
        if num_rows == 0:
            return out
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16; got {head_dim}")
        if debug_kv_indices():
            _check_kv_indices(batch, layer, meta)
        on_gpu = q.device.type == "cuda"
        window = layer.sliding_window

        kv = _LayerKV(k_buffer, v_buffer, req_to_token, full_to_swa, window, k_scale, v_scale)
        if meta.use_decode_kernel:
            _decode(q, out, meta, kv)
            return out
        if meta.verify_rows:
            _verify(q, out, meta, batch, kv)
            return out

        config = default_extend_config(head_dim, num_heads // k_buffer.shape[1], on_gpu, k_buffer.element_size())
        if config.block_q not in meta.tiles:
            meta.tiles[config.block_q] = _tile_table(meta, batch, num_rows, config.block_q)
        extend_attention(
            q,
            out,
            k_buffer,
            v_buffer,
            req_to_token,
            full_to_swa,
            meta.tiles[config.block_q],
            meta.req_pool_indices,
            meta.seq_lens,
            meta.positions,
            window,
            config,
            k_scale,
            v_scale,
            meta.last_visible if window is not None else None,
        )
        if meta.one_row is not None:  # the rows the tiles skipped
            index = meta.one_row_index
            one_row_out = torch.empty((index.shape[0], num_heads, head_dim), dtype=q.dtype, device=q.device)
            _decode(q[index], one_row_out, meta.one_row, kv)
            out.index_copy_(0, index, one_row_out)
        return out


def _tile_table(meta: TritonAttentionMetadata, batch: ForwardBatch, num_rows: int, block_q: int) -> torch.Tensor:
    """The extend kernel's tile table: from the host's lists in one pinned copy where the step is not being
    captured (an eager step: its host launches come before the GPU has work), else built on the device from the
    step's tensors (a captured graph recomputes it from each replay's inputs)."""
    lens, skip = batch.extend_seq_lens_cpu, meta.one_row_requests
    if lens and not (meta.positions.is_cuda and torch.cuda.is_current_stream_capturing()):
        flat = build_extend_tiles_host(lens, num_rows, block_q, skip)
        (table,) = host_to_device([flat], meta.positions.device, torch.int32)
        return table.view(3, -1)
    device_skip = None if skip is None else meta.extend_seq_lens == 1
    return build_extend_tiles(meta.extend_seq_lens, num_rows, block_q, skip=device_skip)


def _image_last_visible(batch: ForwardBatch) -> torch.Tensor | None:
    """Per row, the last kv position it sees in sliding layers when the batch has rows inside images whose
    tokens attend both ways (their image's last position; others their own); None when there are none.
    A chunk never ends inside such an image (`multimodal/chunking.py`), so the whole image has KV."""
    mm = batch.mm
    if mm is None or not mm.bidirectional or not any(mm.request_spans):
        return None
    last = batch.positions.clone()
    row = 0
    for spans, num_rows in zip(mm.request_spans, batch.extend_seq_lens_cpu, strict=True):
        positions = batch.positions[row : row + num_rows]
        for first, end in spans:
            last[row : row + num_rows].masked_fill_((positions >= first) & (positions < end), end - 1)
        row += num_rows
    return last


@dataclass(frozen=True)
class _LayerKV:
    """What a layer's attention reads besides q: its (owner's) buffers and scales, the indirections, its window."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    full_to_swa: torch.Tensor
    window: int | None
    k_scale: float
    v_scale: float


def _decode(q: torch.Tensor, out: torch.Tensor, meta: TritonAttentionMetadata, kv: _LayerKV) -> None:
    """The split-KV decode kernel over `meta`'s rows (one query row each), its partials made once per shape."""
    num_rows, num_heads, head_dim = q.shape
    splits = num_kv_splits(num_rows, kv.k_buffer.shape[1], _num_sms(q.device))
    decode_attention(
        q,
        out,
        kv.k_buffer,
        kv.v_buffer,
        kv.req_to_token,
        kv.full_to_swa,
        meta.row_pool_indices,
        meta.row_seq_lens,
        meta.positions,
        kv.window,
        splits,
        _partials(meta, q, splits),
        default_decode_config(head_dim, q.device.type == "cuda", splits, is_fp8_kv(kv.k_buffer.dtype)),
        kv.k_scale,
        kv.v_scale,
    )


def _partials(meta: TritonAttentionMetadata, q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The split-KV kernels' scratch for q's rows and heads (None for one split), made once per shape a forward."""
    if splits == 1:
        return None
    num_rows, num_heads, head_dim = q.shape
    key = (num_heads, head_dim, splits)
    if key not in meta.partials:
        meta.partials[key] = decode_partials(num_rows, num_heads, head_dim, splits, q.device)
    return meta.partials[key]


def _verify(
    q: torch.Tensor, out: torch.Tensor, meta: TritonAttentionMetadata, batch: ForwardBatch, kv: _LayerKV
) -> None:
    """The verify kernel over `meta`'s requests: tiles of their rows (made once per rows-per-tile), splits chosen
    from the number of tiles as decode's from its rows."""
    num_rows, num_heads, head_dim = q.shape
    kv_heads = kv.k_buffer.shape[1]
    rows_per_tile = verify_tile_rows(meta.verify_rows, num_heads // kv_heads)
    if rows_per_tile not in meta.tiles:
        meta.tiles[rows_per_tile] = _tile_table(meta, batch, num_rows, rows_per_tile)
    # from the tiles that hold rows, not from the requests: a padded verify step has as many requests as rows
    busy_tiles = triton.cdiv(num_rows, meta.verify_rows) * triton.cdiv(meta.verify_rows, rows_per_tile)
    splits = num_kv_splits(busy_tiles, kv_heads, _num_sms(q.device))
    verify_attention(
        q,
        out,
        kv.k_buffer,
        kv.v_buffer,
        kv.req_to_token,
        kv.full_to_swa,
        meta.tiles[rows_per_tile],
        rows_per_tile,
        meta.req_pool_indices,
        meta.seq_lens,
        meta.positions,
        kv.window,
        splits,
        _partials(meta, q, splits),
        default_decode_config(head_dim, q.device.type == "cuda", splits, is_fp8_kv(kv.k_buffer.dtype)),
        kv.k_scale,
        kv.v_scale,
    )


def _split_one_row_requests(meta: TritonAttentionMetadata, batch: ForwardBatch) -> None:
    """Give the one-row requests of a mixed batch to the decode kernel (module docstring), from the host lists
    (a graph is captured on padding whose requests all have several rows or none: its steps never split)."""
    starts = batch.extend_start_loc_cpu
    meta.one_row_requests = [n == 1 for n in batch.extend_seq_lens_cpu]
    requests = [i for i, one_row in enumerate(meta.one_row_requests) if one_row]
    # one pinned copy that the host does not wait for (an eager step's, never a captured one's)
    which, index = host_to_device([requests, [starts[i] for i in requests]], batch.seq_lens.device)
    meta.one_row_index = index
    meta.one_row = _decode_rows(batch, which, batch.positions[index])


def _decode_rows(batch: ForwardBatch, requests: torch.Tensor, positions: torch.Tensor) -> TritonAttentionMetadata:
    """The decode kernel's metadata for one query row of each of `requests` (batch indices), at `positions`."""
    return TritonAttentionMetadata(
        use_decode_kernel=True,
        positions=positions,
        row_pool_indices=batch.req_pool_indices[requests],
        row_seq_lens=batch.seq_lens[requests],
    )


def _check_kv_indices(batch: ForwardBatch, layer: AttentionLayerSpec, meta: TritonAttentionMetadata) -> None:
    """`SRT_DEBUG_KV_INDICES=1`: every buffer row the kernels may read is inside the layer's buffer."""
    pool = batch.kv_pool
    pool_rows = meta.row_pool_indices if meta.use_decode_kernel else meta.req_pool_indices
    longest = int(batch.seq_lens.max())
    full_slots = batch.req_to_token_pool.req_to_token[pool_rows, :longest].reshape(-1).to(torch.int64)
    check_indices(full_slots, pool.allocator.full_size, "full")
    if layer.sliding_window is not None:
        check_indices(pool.allocator.full_to_swa[full_slots], pool.allocator.swa_size, "swa")
