"""Slot allocators, the request table, per-layer KV pools and window freeing: exact slot ids."""

from __future__ import annotations

import pytest
import torch

from srt.configs.model_config import ModelConfig
from srt.mem_cache.allocator import OutOfSlotsError, SWATokenAllocator, TokenSlotAllocator
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.req_to_token_pool import ReqToTokenPool
from srt.mem_cache.swa_window import free_out_of_window


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_token_allocator_hands_out_from_the_front_and_takes_back_at_the_end() -> None:
    alloc = TokenSlotAllocator(6)
    assert ids(alloc.alloc(2)) == [1, 2]  # slot 0 is padding, never handed out
    b = alloc.alloc(3)
    assert ids(b) == [3, 4, 5]
    alloc.free(torch.tensor([2, 1]))
    assert ids(alloc.free_slots()) == [6, 2, 1]
    assert ids(alloc.alloc(2)) == [6, 2]
    with pytest.raises(OutOfSlotsError, match="asked for 2 KV slots, 1 free of 6"):
        alloc.alloc(2)
    alloc.check_integrity()


def test_token_allocator_integrity_catches_a_double_free() -> None:
    alloc = TokenSlotAllocator(4)
    slots = alloc.alloc(2)
    alloc.free(slots)
    alloc.free(slots[:1])
    with pytest.raises(AssertionError, match="twice"):
        alloc.check_integrity()


def test_token_allocator_integrity_catches_a_slot_out_of_range() -> None:
    alloc = TokenSlotAllocator(4)
    alloc.free(torch.tensor([0]))  # slot 0 is padding: never on the free list
    with pytest.raises(AssertionError, match="out of range"):
        alloc.check_integrity()


def test_swa_allocator_maps_each_full_slot_to_its_own_swa_slot() -> None:
    alloc = SWATokenAllocator(full_size=8, swa_size=4)
    full = alloc.alloc(3)
    assert ids(full) == [1, 2, 3]
    assert ids(alloc.translate(full)) == [1, 2, 3]
    assert alloc.available() == 1  # limited by the SWA pool
    alloc.free_swa(full[:2])
    assert ids(alloc.translate(full)) == [0, 0, 3]  # freed -> the padding slot, always readable
    assert ids(alloc.swa.free_slots()) == [4, 1, 2]
    more = alloc.alloc(3)
    assert ids(more) == [4, 5, 6] and ids(alloc.translate(more)) == [4, 1, 2]
    alloc.free(full)  # full slots 1..3; only 3 still had an SWA slot
    assert ids(alloc.full.free_slots()) == [7, 8, 1, 2, 3]
    assert ids(alloc.swa.free_slots()) == [3]
    alloc.check_integrity()


def test_swa_allocator_integrity_catches_a_leaked_or_shared_swa_slot() -> None:
    alloc = SWATokenAllocator(full_size=4, swa_size=4)
    full = alloc.alloc(2)
    alloc.full_to_swa[full[1]] = alloc.full_to_swa[full[0]]
    with pytest.raises(AssertionError, match="same SWA slot"):
        alloc.check_integrity()
    alloc = SWATokenAllocator(full_size=4, swa_size=4)
    full = alloc.alloc(2)
    alloc.full.free(full)  # full slots freed behind the SWA mapping's back
    with pytest.raises(AssertionError, match="free full slot still maps"):
        alloc.check_integrity()


def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(max_requests=2, max_context=8)
    row = pool.alloc()
    pool.write(row, 2, torch.tensor([7, 9]))
    assert pool.req_to_token[row, :4].tolist() == [0, 0, 7, 9]
    assert pool.alloc() == 1 and pool.available() == 0
    with pytest.raises(RuntimeError, match="no free request rows"):
        pool.alloc()
    pool.free(row)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(row)
    pool.check_integrity()


def test_req_to_token_pool_decode_write_and_padding_row() -> None:
    pool = ReqToTokenPool(max_requests=2, max_context=8)
    assert pool.padding_row == 2 and pool.req_to_token.shape == (3, 8)  # never handed out
    pool.write_one_each([1, 0], [3, 5], torch.tensor([11, 12]))
    assert pool.req_to_token[1, 3] == 11 and pool.req_to_token[0, 5] == 12
    pool.check_integrity()
    pool.req_to_token[pool.padding_row, 0] = 4  # CUDA-graph padding rows would read real KV through it
    with pytest.raises(AssertionError, match="padding row"):
        pool.check_integrity()


def test_window_freeing_keeps_exactly_what_the_next_query_reads() -> None:
    # W = 4: the query at position 10 reads 7 8 9 10 (kv > q - W). The first 3 tokens are the prefix cache's.
    #
    #   position   0   1   2 | 3   4   5   6 | 7   8   9 | 10
    #   SWA KV     c   c   c | x   x   x   x | k   k   k | next query
    #                        ^ freed_upto=3  ^ returned 7
    alloc = SWATokenAllocator(full_size=16, swa_size=16)
    row = alloc.alloc(10)
    assert free_out_of_window(alloc, row, freed_upto=3, seq_len=10, window=4) == 7
    assert ids(alloc.translate(row)) == [1, 2, 3, 0, 0, 0, 0, 8, 9, 10]
    assert ids(alloc.swa.free_slots()[-4:]) == [4, 5, 6, 7]
    # One decode step later (seq_len 11) exactly one more token leaves the window; repeating frees nothing.
    row = torch.cat([row, alloc.alloc(1)])
    assert free_out_of_window(alloc, row, 7, 11, 4) == 8
    assert free_out_of_window(alloc, row, 8, 11, 4) == 8
    assert ids(alloc.translate(row[7:])) == [0, 9, 10, 11]
    alloc.check_integrity()


def test_window_freeing_of_a_short_request_frees_nothing() -> None:
    alloc = SWATokenAllocator(full_size=8, swa_size=8)
    row = alloc.alloc(3)
    assert free_out_of_window(alloc, row, 0, 3, window=4) == 0
    assert free_out_of_window(alloc, row, 0, 3, window=1) == 3  # W = 1: a query sees only itself
    with pytest.raises(ValueError, match="freed_upto"):
        free_out_of_window(alloc, row, 4, 3, 4)


def test_kv_pool_shared_layers_read_their_owners_buffers() -> None:
    config = ModelConfig.from_preset("tiny-gemma-4-E4B-it")
    alloc = SWATokenAllocator(full_size=8, swa_size=4)
    pool = HybridKVPool(config.layers, alloc, torch.float32, "cpu")
    shared = next(spec for spec in config.layers if not spec.owns_kv)
    k_shared, _ = pool.kv_buffers(shared.layer_id)
    k_owner, _ = pool.kv_buffers(shared.kv_owner)
    assert k_shared is k_owner
    full_layer = next(spec for spec in config.layers if not spec.is_sliding)
    sliding_layer = next(spec for spec in config.layers if spec.is_sliding and spec.owns_kv)
    assert pool.kv_buffers(full_layer.layer_id)[0].shape[0] == 9  # 8 slots + padding
    assert pool.kv_buffers(sliding_layer.layer_id)[0].shape[0] == 5
    slots = alloc.alloc(2)
    alloc.free_swa(slots[:1])
    assert ids(pool.layer_slots(sliding_layer.layer_id, slots)) == [0, 2]
    assert ids(pool.layer_slots(full_layer.layer_id, slots)) == [1, 2]
    with pytest.raises(ValueError, match="shares KV"):
        pool.write(shared.layer_id, slots, torch.zeros(2, 2, 32), torch.zeros(2, 2, 32))
    # what fused kernels write through: the layer's own buffers and, on sliding layers, full_to_swa
    sliding_target, full_target = pool.cache_target(sliding_layer.layer_id), pool.cache_target(full_layer.layer_id)
    assert sliding_target.k_buffer is pool.kv_buffers(sliding_layer.layer_id)[0]
    assert sliding_target.full_to_swa is alloc.full_to_swa and full_target.full_to_swa is None
    assert ids(sliding_target.rows(slots)) == [0, 2] and ids(full_target.rows(slots)) == [1, 2]
    with pytest.raises(ValueError, match="shares KV"):
        pool.cache_target(shared.layer_id)
    pool.check_integrity()
    pool._v[sliding_layer.layer_id] = torch.zeros(9, 2, 32)  # sized for the full pool by mistake
    with pytest.raises(AssertionError, match=r"V buffer is \(9, 2, 32\)"):
        pool.check_integrity()
