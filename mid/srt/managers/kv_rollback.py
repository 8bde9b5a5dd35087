"""A request gives back the KV of its last n tokens (rejected speculative drafts, a step taken back).

Only the request's own tokens can go: the cached prefix it holds locked belongs to the prefix cache. Example,
prefix_len 3, kv_len 10, window W = 4, n = 2:

    position        0  1  2 | 3  4  5  6  7 | 8  9
    full slot       c  c  c | r  r  r  r  r | g  g        c = the cache's, r = the request's, g = given back
    SWA slot        c  c  c | x  x  k  k  k | g  g        x = freed by the window cursor (swa_freed_upto 5)
                                            ^ new kv_len 8: the next query, at position 8, reads 5 6 7 8

Given back: the full slots of positions 8 and 9, their SWA slots (through `full_to_swa`, which returns to 0),
and their entries of the request's `req_to_token` row (back to slot 0, the padding slot). `kv_len` moves to 8;
the SWA cursor stays where it was when no position the next query reads was freed, which the caller must
have made sure of (the scheduler frees sliding-window KV only W - 1 tokens behind the newest): a rollback
that would need freed SWA KV back is refused, as is one that reaches into the cached prefix.
"""

from __future__ import annotations

import torch

from srt.managers.request_kv import TokenPositions, free_kv
from srt.managers.schedule_batch import Req
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.req_to_token_pool import ReqToTokenPool


def give_back_kv(
    req: Req, num_tokens: int, req_to_token_pool: ReqToTokenPool, allocator: SWATokenAllocator, window: int
) -> torch.Tensor:
    """Free the KV of `req`'s last `num_tokens` tokens (full and SWA slots, their `req_to_token` entries) and
    move its `kv_len` back; returns the full slots given back. Raises ValueError, changing nothing, when the
    tokens reach into the cached prefix or the next query would need sliding-window KV already freed.

    Call it between steps: no step in flight may still write the tokens' KV. `req.output_ids` is left alone:
    output tokens whose KV is given back are computed again by the next step that runs the request.
    """
    return give_back_kv_of([req], [num_tokens], req_to_token_pool, allocator, window)


def give_back_kv_of(
    reqs: list[Req], num_tokens: list[int], req_to_token_pool: ReqToTokenPool, allocator: SWATokenAllocator, window: int
) -> torch.Tensor:
    """`give_back_kv` for several requests at once (a verify step's): every request is checked before anything
    changes, then one gather, one free and one write serve them all, with nothing read back from the device."""
    given_back = take_back_kv_lens(reqs, num_tokens, window)
    return free_kv(given_back, TokenPositions(), req_to_token_pool, allocator)


def take_back_kv_lens(reqs: list[Req], num_tokens: list[int], window: int) -> TokenPositions:
    """The host half of `give_back_kv_of`: checks every request, moves each `kv_len` back and returns the positions
    whose KV is given back, for `request_kv.free_kv` to free (with the step's window frees, in one gather)."""
    for req, num in zip(reqs, num_tokens, strict=True):
        _check(req, num, window)
    given_back = TokenPositions()
    for req, num in zip(reqs, num_tokens, strict=True):
        given_back.add(req.req_pool_idx, req.kv_len - num, req.kv_len)
        req.kv_len -= num
    return given_back


def _check(req: Req, num_tokens: int, window: int) -> None:
    if req.req_pool_idx is None:
        raise ValueError(f"request {req.rid} holds no KV")
    prefix_len = req.prefix.prefix_len if req.prefix is not None else 0
    own = req.kv_len - prefix_len
    if not 0 <= num_tokens <= own:
        raise ValueError(f"num_tokens must be in [0, {own}] (the request's own tokens); got {num_tokens}")
    new_len = req.kv_len - num_tokens
    first_read = max(new_len - window + 1, prefix_len)  # the oldest own position the next query reads
    if req.swa_freed_upto > first_read:
        raise ValueError(
            f"request {req.rid}: positions {first_read}..{req.swa_freed_upto - 1} have no sliding-window KV "
            f"left, and the query at position {new_len} would read them"
        )
