"""kernels/attention/: the `triton` attention backend's kernels against the `torch_native` reference over the
same paged KV.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set in conftest.py before
anything imports triton) at small shapes: head_dim 32 (sliding) and 64 (full), GQA 4/2 and 4/1, window 8,
requests with prefix hits, a request with no rows, single-row requests, decode rows with split KV, SWA slots freed
outside the window and handed to other tokens, the padding slot filled with large values, and KV-shared
layers reading their owner's buffers. With CUDA the same scenarios run on the GPU, plus the `gpu` tests at
Gemma 4 shapes (head_dim 256 and 512, bf16) and the tiny checkpoint's greedy outputs under both backends.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from srt.configs.model_config import FULL, SLIDING, AttentionLayerSpec
from srt.forward.forward_batch import ForwardBatch, ForwardMode
from srt.kernels.attention import decode as decode_kernels
from srt.kernels.attention import verify as verify_kernels
from srt.kernels.attention.extend import build_extend_tiles, build_extend_tiles_host
from srt.kernels.kv_quant import to_buffer
from srt.layers.attention import create_attention_backend, triton_backend
from srt.layers.attention.triton_backend import TritonAttentionBackend
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.kv_cache_dtype import KVScales
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.multimodal.inputs import MultimodalBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WINDOW = 8
HEADS = 4
FP32_TOL = 1e-4
# bf16 queries and probabilities (the P @ V operand) against an fp32 softmax over the same bf16 K/V
BF16_TOL = 2e-2
# (sliding kv_heads, full kv_heads, window): GQA 4/2 and 4/1 on each head_dim; a window of 8 is shorter than a
# KV block (every sliding block is masked), one of 24 leaves whole blocks that every row of a tile sees
GQA = [(2, 1, 8), (1, 2, 24)]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_layers(
    sliding_kv: int, full_kv: int, heads: int = HEADS, dims: tuple[int, int] = (32, 64), window: int = WINDOW
) -> tuple[AttentionLayerSpec, ...]:
    """Two KV-owning layers (sliding, full) and one KV-shared layer reading each."""
    sliding_dim, full_dim = dims
    return (
        AttentionLayerSpec(0, SLIDING, sliding_dim, heads, sliding_kv, False, 0, window),
        AttentionLayerSpec(1, FULL, full_dim, heads, full_kv, False, 1, None),
        AttentionLayerSpec(2, SLIDING, sliding_dim, heads, sliding_kv, False, 0, window),
        AttentionLayerSpec(3, FULL, full_dim, heads, full_kv, False, 1, None),
    )


class PagedState:
    """Pools with requests whose prefix KV is random, for running one batch through both backends."""

    def __init__(
        self,
        layers,
        dtype: torch.dtype = torch.float32,
        full_size: int = 512,
        swa_size: int = 256,
        scales: dict[int, KVScales] | None = None,
    ):
        """`dtype`: the K/V buffers' (float8_e4m3fn with `scales` per owning layer, as HybridKVPool takes)."""
        self.layers = layers
        self.dtype = dtype
        self.allocator = SWATokenAllocator(full_size, swa_size, DEVICE)
        self.pool = HybridKVPool(layers, self.allocator, dtype, DEVICE, scales)
        self.req_to_token = ReqToTokenPool(8, 4096, DEVICE)
        self.seq_lens: dict[int, int] = {}
        # the padding slot holds large values: a kernel that lets a masked position through is visibly wrong
        for spec in layers:
            if spec.owns_kv:
                k, v = self.pool.kv_buffers(spec.layer_id)
                k_scale, v_scale = self.pool.kv_scales(spec.layer_id)
                k[0] = to_buffer(torch.randn(k[0].shape, device=DEVICE) * 30, k.dtype, k_scale)
                v[0] = to_buffer(torch.randn(v[0].shape, device=DEVICE) * 30, v.dtype, v_scale)

    def add_request(self, cached: int) -> int:
        """A request row whose first `cached` tokens have random KV in every owning layer."""
        row = self.req_to_token.alloc()
        self.seq_lens[row] = 0
        self.extend(row, cached)
        return row

    def extend(self, row: int, count: int) -> torch.Tensor:
        """Slots for `count` more tokens of the request, with random KV written for them."""
        slots = self.allocator.alloc(count)
        self.req_to_token.write(row, self.seq_lens[row], slots)
        self.seq_lens[row] += count
        for spec in self.layers:
            if spec.owns_kv:
                shape = (count, spec.num_kv_heads, spec.head_dim)
                k, v = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
                self.pool.write(spec.layer_id, slots.to(DEVICE), k, v)
        return slots

    def free_outside_window(self, row: int, first_visible: int) -> None:
        """Free the SWA slots of positions before `first_visible` (no query of the request sees them)."""
        self.allocator.free_swa(self.req_to_token.req_to_token[row, :first_visible].to(torch.int64))

    def fill_swa(self, leave: int) -> int:
        """A filler request that takes all but `leave` free SWA slots, so freed slots get reused next."""
        return self.add_request(self.allocator.available() - leave)

    def new_slots(self, row: int, count: int) -> torch.Tensor:
        """Slots for `count` new tokens whose KV the forward itself writes."""
        slots = self.allocator.alloc(count)
        self.req_to_token.write(row, self.seq_lens[row], slots)
        self.seq_lens[row] += count
        return slots

    def batch(self, mode: ForwardMode, rows: list[int], new_counts: list[int], out_cache_loc: torch.Tensor):
        prefix = [self.seq_lens[r] - n for r, n in zip(rows, new_counts, strict=True)]
        return ForwardBatch.build(
            mode=mode,
            new_token_ids=[[1] * n for n in new_counts],
            prefix_lens=prefix,
            req_pool_indices=rows,
            out_cache_loc=out_cache_loc,
            logits_rows=[],
            req_to_token_pool=self.req_to_token,
            kv_pool=self.pool,
        )

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.req_to_token.check_integrity()


def compare_backends(
    state: PagedState, batch: ForwardBatch, save_kv: bool = True, dtype: torch.dtype = torch.float32
) -> list[float]:
    """Write each KV-owning layer's new K/V (`save_kv`), then run the layer through torch_native and triton (same
    q); assert equal outputs, return errors."""
    reference, triton_backend = create_attention_backend("torch_native"), create_attention_backend("triton")
    assert isinstance(triton_backend, TritonAttentionBackend)
    # each backend keeps its own metadata in its own shallow copy of the batch
    ref_batch, triton_batch = dataclasses.replace(batch), dataclasses.replace(batch)
    reference.init_forward_metadata(ref_batch)
    triton_backend.init_forward_metadata(triton_batch)
    errors = []
    for spec in state.layers:
        rows = batch.num_tokens
        q = torch.randn(rows, spec.num_heads, spec.head_dim, device=DEVICE, dtype=dtype)
        if save_kv and spec.owns_kv:
            k = torch.randn(rows, spec.num_kv_heads, spec.head_dim, device=DEVICE, dtype=dtype)
            v = torch.randn(rows, spec.num_kv_heads, spec.head_dim, device=DEVICE, dtype=dtype)
            batch.kv_pool.write(spec.layer_id, batch.out_cache_loc, k, v)
        # the reference runs on fp32 copies of q (K/V are cast to q's dtype inside it): the exact answer
        expected = reference.forward(q.float(), spec, ref_batch)
        got = triton_backend.forward(q, spec, triton_batch)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert torch.isfinite(got).all(), f"layer {spec.layer_id}: non-finite output"
        error = float((got.float() - expected).abs().max())
        errors.append(error)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL, msg=f"layer {spec.layer_id}")
    return errors


def prefix_hit_state(sliding_kv: int, full_kv: int, window: int) -> tuple[PagedState, ForwardBatch]:
    """An extend batch: a fresh prompt, two prefix hits (7 rows and 1 row) and a request with no rows.

    SWA slots outside every window are freed and handed to a filler request before the batch's own tokens
    take the rest, so a kernel reading a stale mapping would read another token's KV.
    """
    torch.manual_seed(0)
    state = PagedState(make_layers(sliding_kv, full_kv, window=window))
    fresh = state.add_request(0)
    hit = state.add_request(14)  # its tile at 14..17 sees 0..14: the unmasked blocks end right at 15
    one_row = state.add_request(13)
    no_rows = state.add_request(9)
    state.free_outside_window(hit, max(14 - window + 1, 0))
    state.free_outside_window(one_row, max(13 - window + 1, 0))
    state.fill_swa(leave=38)
    slots = [state.new_slots(fresh, 30), state.new_slots(hit, 7), state.new_slots(one_row, 1)]
    out_loc = torch.cat(slots)
    batch = state.batch(ForwardMode.EXTEND, [fresh, hit, one_row, no_rows], [30, 7, 1, 0], out_loc)
    return state, batch


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_extend_with_prefix_hits_matches_torch_native(sliding_kv: int, full_kv: int, window: int) -> None:
    state, batch = prefix_hit_state(sliding_kv, full_kv, window)
    compare_backends(state, batch)
    state.check_integrity()


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_mixed_step_gives_one_row_requests_to_the_decode_kernel(sliding_kv: int, full_kv: int, window: int) -> None:
    """Decoding requests (one row, long prefixes) beside a prompt chunk: the tiles skip them, the split-KV
    decode kernel computes their rows, and every row still matches torch_native."""
    torch.manual_seed(3)
    state = PagedState(make_layers(sliding_kv, full_kv, window=window))
    decoding = [state.add_request(n) for n in (70, 5, 41)]
    chunked = state.add_request(20)  # a prompt's second chunk, between the decoding requests
    last = state.add_request(64)
    rows = [decoding[0], chunked, decoding[1], last, decoding[2]]
    counts = [1, 12, 1, 1, 1]
    out_loc = torch.cat([state.new_slots(row, n) for row, n in zip(rows, counts, strict=True)])
    batch = state.batch(ForwardMode.EXTEND, rows, counts, out_loc)
    probe = dataclasses.replace(batch)
    create_attention_backend("triton").init_forward_metadata(probe)
    assert probe.attn_metadata.one_row_index.tolist() == [0, 13, 14, 15]  # the one-row requests' rows
    assert probe.attn_metadata.one_row_requests == [True, False, True, True, True]
    compare_backends(state, batch)
    state.check_integrity()


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_decode_with_split_kv_matches_torch_native(sliding_kv: int, full_kv: int, window: int) -> None:
    torch.manual_seed(1)
    state = PagedState(make_layers(sliding_kv, full_kv, window=window))
    lengths = [90, 5, 33, 17]  # one longer than a split, one shorter than the window
    rows = [state.add_request(n) for n in lengths]
    for row, n in zip(rows, lengths, strict=True):
        state.free_outside_window(row, max(n + 1 - window, 0))  # the new token is at position n
    state.fill_swa(leave=len(rows))
    out_loc = torch.cat([state.new_slots(row, 1) for row in rows])
    batch = state.batch(ForwardMode.DECODE, rows, [1] * len(rows), out_loc)
    compare_backends(state, batch)
    state.check_integrity()


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_kernel_any_split_count_gives_the_same_output(num_splits: int) -> None:
    torch.manual_seed(2)
    state = PagedState(make_layers(2, 1))
    rows = [state.add_request(n) for n in (70, 3, 41)]
    out_loc = torch.cat([state.new_slots(row, 1) for row in rows])
    batch = state.batch(ForwardMode.DECODE, rows, [1] * len(rows), out_loc)
    reference = create_attention_backend("torch_native")
    reference.init_forward_metadata(batch)
    for spec in state.layers[:2]:
        q = torch.randn(len(rows), HEADS, spec.head_dim, device=DEVICE)
        expected = reference.forward(q, spec, batch)
        got = torch.full_like(q, float("nan"))
        k_buffer, v_buffer = state.pool.kv_buffers(spec.layer_id)
        partials = decode_kernels.decode_partials(len(rows), HEADS, spec.head_dim, num_splits, DEVICE)
        decode_kernels.decode_attention(
            q,
            got,
            k_buffer,
            v_buffer,
            state.req_to_token.req_to_token,
            state.allocator.full_to_swa,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.positions,
            spec.sliding_window,
            num_splits,
            partials,
            decode_kernels.default_decode_config(spec.head_dim, DEVICE.type == "cuda"),
        )
        torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL)


def verify_state(sliding_kv: int, full_kv: int, window: int, counts: list[int]) -> tuple[PagedState, ForwardBatch]:
    """A verify step: requests with long prefixes (split KV) and `counts` rows each (the newest token and its
    drafts; 1: no drafts left; 0: a graph's padding request), their SWA slots outside every window freed and
    handed to a filler request, as `test_decode_with_split_kv_matches_torch_native`."""
    state = PagedState(make_layers(sliding_kv, full_kv, window=window))
    lengths = [70, 5, 33, 9, 12][: len(counts)]
    rows = [state.add_request(n) for n in lengths]
    for row, n in zip(rows, lengths, strict=True):
        state.free_outside_window(row, max(n + 1 - window, 0))  # the first new row is at position n
    state.fill_swa(leave=sum(counts))
    out_loc = torch.cat([state.new_slots(row, n) for row, n in zip(rows, counts, strict=True)])
    batch = state.batch(ForwardMode.EXTEND, rows, counts, out_loc)
    batch.verify_rows = max(counts)
    return state, batch


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
@pytest.mark.parametrize("counts", [[4, 1, 4, 3, 0], [9, 1, 9]], ids=["K3", "K8"])
@pytest.mark.parametrize("together", [True, False], ids=["verify_kernel", "row_by_row"])
def test_verify_rows_match_torch_native(
    sliding_kv: int, full_kv: int, window: int, counts: list[int], together: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verify kernel takes a request's rows together (K = 8 at GQA 4/1: two tiles of a request), each row
    masked by its own causal and window bounds; a step of fewer requests than VERIFY_KERNEL_MIN_REQUESTS runs
    the decode kernel row by row: torch_native's outputs either way, KV-shared layers included."""
    monkeypatch.setattr(triton_backend, "VERIFY_KERNEL_MIN_REQUESTS", 1 if together else 100)
    torch.manual_seed(4)
    state, batch = verify_state(sliding_kv, full_kv, window, counts)
    probe = dataclasses.replace(batch)
    create_attention_backend("triton").init_forward_metadata(probe)
    assert probe.attn_metadata.verify_rows == (max(counts) if together else 0)
    assert probe.attn_metadata.use_decode_kernel != together
    compare_backends(state, batch)
    state.check_integrity()


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_verify_kernel_any_split_count_gives_the_same_output(num_splits: int) -> None:
    torch.manual_seed(5)
    state, batch = verify_state(2, 1, WINDOW, [4, 1, 4, 3])
    compare_backends(state, batch)  # writes the step's KV
    reference = create_attention_backend("torch_native")
    reference.init_forward_metadata(batch)
    for spec in state.layers[:2]:
        q = torch.randn(batch.num_tokens, HEADS, spec.head_dim, device=DEVICE)
        expected = reference.forward(q, spec, batch)
        rows_per_tile = verify_kernels.verify_tile_rows(4, HEADS // spec.num_kv_heads)
        tiles = build_extend_tiles(batch.extend_seq_lens, batch.num_tokens, rows_per_tile)
        got = torch.full_like(q, float("nan"))
        k_buffer, v_buffer = state.pool.kv_buffers(spec.layer_id)
        partials = decode_kernels.decode_partials(batch.num_tokens, HEADS, spec.head_dim, num_splits, DEVICE)
        verify_kernels.verify_attention(
            q, got, k_buffer, v_buffer, state.req_to_token.req_to_token, state.allocator.full_to_swa, tiles,
            rows_per_tile, batch.req_pool_indices, batch.seq_lens, batch.positions, spec.sliding_window, num_splits,
            partials, decode_kernels.default_decode_config(spec.head_dim, DEVICE.type == "cuda"),
        )  # fmt: skip
        torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_row_subsets_attend_over_the_whole_prefix(sliding_kv: int, full_kv: int, window: int) -> None:
    """YOCO: after the KV-owning layers, only some rows of each request run, each over its full prefix.

    Batch rows (`prefix_hit_state`): fresh 0..29 at positions 0..29, hit 30..36 at 14..20, one_row 37 at 13.
    """
    state, batch = prefix_hit_state(sliding_kv, full_kv, window)
    compare_backends(state, batch)  # writes the batch's KV
    # rows from a position on (several rows per request: the extend kernel): fresh 21..29, hit 18..20 ...
    several = batch.select_rows([*range(21, 30), 34, 35, 36])
    compare_backends(state, several, save_kv=False)
    # ... and only the last row of some requests (one row each: the split-KV kernel), hit and no_rows skipped
    last = batch.select_rows([29, 37])
    compare_backends(state, last, save_kv=False)
    state.check_integrity()


@pytest.mark.parametrize("sliding_kv,full_kv,window", GQA)
def test_image_rows_see_their_whole_image_in_sliding_layers(sliding_kv: int, full_kv: int, window: int) -> None:
    """26B-A4B / 31B: rows inside an image see the rest of it in sliding layers (the window still counted back
    from their own position); full layers stay causal. Batch rows (`prefix_hit_state`): fresh at 0..29 with
    images at 3..14 (longer than the window of 8) and 20..25, hit at 14..20 with an image at 16..20 and one
    inside its cached prefix; then the YOCO subsets of `test_row_subsets_attend_over_the_whole_prefix`."""
    state, batch = prefix_hit_state(sliding_kv, full_kv, window)
    spans = [[(3, 15), (20, 26)], [(2, 9), (16, 21)], [], []]
    batch.mm = MultimodalBatch(rows=[], request_spans=spans, bidirectional=True)
    compare_backends(state, batch)
    compare_backends(state, batch.select_rows([*range(10, 30), 34, 35, 36]), save_kv=False)
    compare_backends(state, batch.select_rows([12, 37]), save_kv=False)  # one row each, one inside an image
    state.check_integrity()


def test_debug_kv_indices_rejects_a_slot_outside_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """SRT_DEBUG_KV_INDICES=1: a req_to_token entry past the full pool stops the forward before any kernel."""
    monkeypatch.setenv("SRT_DEBUG_KV_INDICES", "1")
    state, batch = prefix_hit_state(2, 1, WINDOW)
    compare_backends(state, batch)  # every index in range: the checks pass
    hit_row = int(batch.req_pool_indices[1])
    state.req_to_token.req_to_token[hit_row, 3] = state.allocator.full_size + 1
    backend = TritonAttentionBackend()
    backend.init_forward_metadata(batch)
    for spec in state.layers[:2]:
        q = torch.randn(batch.num_tokens, spec.num_heads, spec.head_dim, device=DEVICE)
        with pytest.raises(IndexError, match="full KV index out of range"):
            backend.forward(q, spec, batch)


def test_extend_tiles_cover_every_row_once_last_tile_first() -> None:
    lens = torch.tensor([5, 0, 1, 8], device=DEVICE)
    tiles = build_extend_tiles(lens, num_rows=14, block_q=4).cpu()
    # n = cdiv(14, 4) + 4 requests = 8; request 0: rows 0..4 (tiles at 4, 0), request 2: row 5,
    # request 3: rows 6..13 (tiles at 10, 6); the 3 surplus tiles cover no rows (first == end)
    assert tiles.tolist() == [
        [0, 0, 2, 3, 3, 3, 3, 3],
        [4, 0, 5, 10, 6, 14, 14, 14],
        [5, 5, 6, 14, 14, 14, 14, 14],
    ]


def test_extend_tiles_skip_the_requests_left_to_the_decode_kernel() -> None:
    lens = torch.tensor([5, 0, 1, 8], device=DEVICE)
    skip = torch.tensor([False, False, True, False], device=DEVICE)
    tiles = build_extend_tiles(lens, num_rows=14, block_q=4, skip=skip).cpu()
    # as without `skip`, but request 2 (row 5) gets no tile: a fourth surplus tile instead
    assert tiles.tolist() == [
        [0, 0, 3, 3, 3, 3, 3, 3],
        [4, 0, 10, 6, 14, 14, 14, 14],
        [5, 5, 14, 14, 14, 14, 14, 14],
    ]


def test_extend_tiles_from_the_host_lists_equal_the_device_build() -> None:
    """`build_extend_tiles_host` (eager steps) gives the table `build_extend_tiles` (captured steps) builds, with
    and without skipped requests, empty requests and padded rows (a graph's num_rows above the real ones)."""
    rng = random.Random(7)
    for _ in range(200):
        lens = [rng.choice([0, 1, 1, rng.randint(1, 40)]) for _ in range(rng.randint(1, 6))]
        skip = [n == 1 and rng.random() < 0.7 for n in lens] if rng.random() < 0.5 else None
        num_rows, block_q = sum(lens) + rng.choice([0, 0, 5]), rng.choice([1, 4, 16, 32])
        skip_tensor = None if skip is None else torch.tensor(skip, device=DEVICE)
        device = build_extend_tiles(torch.tensor(lens, device=DEVICE), num_rows, block_q, skip=skip_tensor)
        host = build_extend_tiles_host(lens, num_rows, block_q, skip)
        assert host == device.cpu().flatten().tolist(), (lens, skip, num_rows, block_q)


def test_decode_split_count_fills_the_gpu_and_is_bounded() -> None:
    assert decode_kernels.num_kv_splits(num_rows=1, kv_heads=2, num_sms=132) == decode_kernels.MAX_KV_SPLITS
    assert decode_kernels.num_kv_splits(num_rows=32, kv_heads=2, num_sms=132) == 4  # about one wave
    assert decode_kernels.num_kv_splits(num_rows=512, kv_heads=2, num_sms=132) == 1


# ---- GPU: Gemma 4 shapes in bf16, and the tiny model end to end ----


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "heads,sliding_kv,full_kv,dtype",
    [(8, 2, 2, torch.bfloat16), (8, 1, 1, torch.bfloat16), (32, 16, 4, torch.bfloat16), (16, 8, 2, torch.bfloat16),
     (8, 2, 2, torch.float32)],
)  # fmt: skip
def test_gemma4_shapes_match_fp32_reference(heads: int, sliding_kv: int, full_kv: int, dtype: torch.dtype) -> None:
    """E4B, E2B, 31B and 26B heads; head_dim 256 (sliding, window 512) and 512 (full); bf16 (and fp32) KV."""
    torch.manual_seed(3)
    layers = make_layers(sliding_kv, full_kv, heads, dims=(256, 512), window=512)
    state = PagedState(layers, dtype, full_size=8192, swa_size=8192)
    fresh, hit = state.add_request(0), state.add_request(700)
    state.free_outside_window(hit, 700 - 512 + 1)
    out_loc = torch.cat([state.new_slots(fresh, 1000), state.new_slots(hit, 300)])
    batch = state.batch(ForwardMode.EXTEND, [fresh, hit], [1000, 300], out_loc)
    errors = compare_backends(state, batch, dtype=dtype)
    assert max(errors) < BF16_TOL, errors
    rows = [state.add_request(n) for n in (1500, 37, 3000)]
    out_loc = torch.cat([state.new_slots(row, 1) for row in [fresh, hit, *rows]])
    decode = state.batch(ForwardMode.DECODE, [fresh, hit, *rows], [1] * 5, out_loc)
    errors = compare_backends(state, decode, dtype=dtype)
    assert max(errors) < BF16_TOL, errors
    state.check_integrity()


@pytest.mark.gpu
@requires_cuda
def test_tiny_model_greedy_outputs_match_torch_native(tiny_checkpoint) -> None:
    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.static_batch import generate_greedy
    from srt.server_args import ServerArgs

    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 41)]
    results = {}
    for backend in ("torch_native", "triton"):
        args = ServerArgs(
            model_path=str(path), device="cuda", dtype="float32", attention_backend=backend, max_total_tokens=4096
        )
        runner = ModelRunner(args)
        assert isinstance(runner.attn_backend, TritonAttentionBackend) == (backend == "triton")
        results[backend] = generate_greedy(runner, prompts, 12)
        del runner
    assert results["triton"].output_ids == results["torch_native"].output_ids
    for ours, ref in zip(results["triton"].step_logits, results["torch_native"].step_logits, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@requires_cuda
def test_decode_forward_captures_in_a_cuda_graph() -> None:
    """Decode reads nothing back to the host: the KV write and the forward replay from a CUDA graph."""
    torch.manual_seed(4)
    state = PagedState(make_layers(2, 2, 8, dims=(256, 512), window=512), torch.bfloat16, 8192, 8192)
    rows = [state.add_request(n) for n in (700, 40, 2000)]
    out_loc = torch.cat([state.new_slots(row, 1) for row in rows])
    batch = state.batch(ForwardMode.DECODE, rows, [1] * len(rows), out_loc)
    backend = TritonAttentionBackend()
    backend.init_forward_metadata(batch)
    reference = create_attention_backend("torch_native")
    ref_batch = dataclasses.replace(batch)
    reference.init_forward_metadata(ref_batch)
    for spec in state.layers[:2]:
        shape_q, shape_kv = (len(rows), spec.num_heads, spec.head_dim), (len(rows), spec.num_kv_heads, spec.head_dim)
        q = torch.randn(shape_q, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(shape_kv, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(shape_kv, device=DEVICE, dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            state.pool.write(spec.layer_id, batch.out_cache_loc, k, v)
            backend.forward(q, spec, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            state.pool.write(spec.layer_id, batch.out_cache_loc, k, v)
            out = backend.forward(q, spec, batch)
        for tensor in (q, k, v):  # new inputs in the captured buffers
            tensor.normal_()
        graph.replay()
        expected = reference.forward(q.float(), spec, ref_batch)
        assert float((out.float() - expected).abs().max()) < BF16_TOL
