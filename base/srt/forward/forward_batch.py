"""The one batch object the model sees.

Every request in a batch contributes `extend_seq_lens[i]` new tokens after `extend_prefix_lens[i]` tokens
whose KV is already in the pools; a fresh prompt, a prefix-cache hit, a prefill chunk and a decode step
(one new token) are all the same layout:

    rows:      | req 0: positions p0 .. s0-1 | req 1: positions p1 .. s1-1 | ...
    seq_lens:  s_i = prefix_i + extend_i  (tokens with KV once this forward has run)
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from srt.forward.host_device import host_to_device

if TYPE_CHECKING:
    from srt.mem_cache.kv_pool import HybridKVPool
    from srt.mem_cache.req_to_token_pool import ReqToTokenPool
    from srt.multimodal.inputs import MultimodalBatch


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # prompt tokens (fresh, after a prefix hit, or one chunk)
    DECODE = enum.auto()  # one new token per request

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over paged KV. Tensors live on the model's device."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    req_pool_indices: torch.Tensor  # [batch] rows of req_to_token
    seq_lens: torch.Tensor  # [batch]
    extend_prefix_lens: torch.Tensor  # [batch]
    extend_seq_lens: torch.Tensor  # [batch]
    out_cache_loc: torch.Tensor  # [tokens] full-pool slots the new tokens' KV goes to
    logits_rows: torch.Tensor  # rows whose logits the caller needs, ascending
    req_to_token_pool: ReqToTokenPool
    kv_pool: HybridKVPool
    # host copies, so per-request loops need no device sync
    req_pool_indices_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    logits_rows_cpu: list[int] = field(default_factory=list)
    attn_metadata: Any = None  # built by the attention backend's init_forward_metadata
    # the logits rows as a batch of their own, laid out on the device by the caller (a captured step, whose host
    # lists cannot describe the batch it replays, and whose padded logits rows are not "every row in order" even
    # when there are as many as tokens); without it `logits_batch()` derives it with `select_rows`
    logits_subset: ForwardBatch | None = None
    # attention runs each query row alone over its request's KV up to its position (a few rows per request over
    # a long prefix: speculative verify steps); only a hint for the kernel choice, the result is the same
    attend_row_by_row: bool = False
    # rows that take image embeddings and each request's image spans (None: a text-only batch)
    mm: MultimodalBatch | None = None

    def __post_init__(self) -> None:
        # the model decides "every row needed?" from the host list: it must describe the device one
        if len(self.logits_rows_cpu) != len(self.logits_rows):
            rows, host_rows = len(self.logits_rows), len(self.logits_rows_cpu)
            raise ValueError(f"logits_rows_cpu has {host_rows} rows, logits_rows {rows}")

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def every_row_is_a_logits_row(self) -> bool:
        """Every row's logits are needed, in row order (decode, verify, prompt logprobs of every row)."""
        return self.logits_subset is None and len(self.logits_rows_cpu) == self.num_tokens

    def token_req_pool_indices(self) -> torch.Tensor:
        """[tokens] each token's request row (`req_pool_indices` repeated over each request's tokens), on the
        device; the known length keeps the host from waiting for it."""
        if self.mode.is_decode():
            return self.req_pool_indices
        return self.req_pool_indices.repeat_interleave(self.extend_seq_lens, output_size=self.num_tokens)

    def logits_batch(self) -> ForwardBatch:
        """The batch of the logits rows alone (YOCO's KV-shared layers run on it)."""
        return self.logits_subset if self.logits_subset is not None else self.select_rows(self.logits_rows_cpu)

    @property
    def extend_start_loc_cpu(self) -> list[int]:
        starts, total = [], 0
        for n in self.extend_seq_lens_cpu:
            starts.append(total)
            total += n
        return starts

    def requests_of_rows(self, rows: list[int]) -> list[int]:
        """The request holding each row: the last one starting at or before it (requests with no rows share
        their start with the next)."""
        starts = self.extend_start_loc_cpu
        return [bisect.bisect_right(starts, row) - 1 for row in rows]

    def select_rows(self, rows: torch.Tensor | list[int]) -> ForwardBatch:
        """The batch restricted to query rows `rows` (ascending; each request's chosen rows contiguous).

        Requests keep their slot, `req_pool_indices` and `seq_lens`: each chosen row still attends over its
        request's whole prefix, whose KV is already in the pools. A request may keep 0 rows. Every row of the
        result is a logits row. Attention metadata is left for the caller to build for the subset:

            rows:      | req 0: p0 .. s0-1 | req 1: p1 .. s1-1 |        (this batch)
            chosen:              ^^ s0-2, s0-1          ^ s1-1
            subset:    | req 0: s0-2 s0-1 | req 1: s1-1 |             extend_seq_lens [2, 1]
        """
        chosen = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if any(b <= a for a, b in itertools.pairwise(chosen)) or (
            chosen and (chosen[0] < 0 or chosen[-1] >= self.num_tokens)
        ):
            raise ValueError(f"rows must be ascending, unique and in 0..{self.num_tokens - 1}; got {chosen}")
        starts = self.extend_start_loc_cpu
        counts = [0] * self.batch_size
        firsts: list[int | None] = [None] * self.batch_size
        for row, req in zip(chosen, self.requests_of_rows(chosen), strict=True):
            if firsts[req] is None:
                firsts[req] = row
            elif firsts[req] + counts[req] != row:
                raise ValueError(f"rows of request {req} are not contiguous: {chosen}")
            counts[req] += 1
        # a request's first chosen row sits at position prefix + (row - start): tokens before it have KV
        prefix_lens = [
            seq_len if first is None else prefix + first - start
            for seq_len, prefix, first, start in zip(
                self.seq_lens_cpu, self.extend_prefix_lens_cpu, firsts, starts, strict=True
            )
        ]
        device = self.input_ids.device
        # one pinned copy: YOCO takes the logits rows in the middle of a prefill's forward, where a plain
        # torch.tensor(..., device="cuda") would make the host wait for the layers launched before it
        index, extend_prefix_lens, extend_seq_lens = host_to_device([chosen, prefix_lens, counts], device)
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[index],
            positions=self.positions[index],
            extend_prefix_lens=extend_prefix_lens.to(self.extend_prefix_lens.dtype),
            extend_seq_lens=extend_seq_lens.to(self.extend_seq_lens.dtype),
            out_cache_loc=self.out_cache_loc[index],
            logits_rows=torch.arange(len(chosen), dtype=torch.int64, device=device),
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=counts,
            logits_rows_cpu=list(range(len(chosen))),
            attn_metadata=None,
            logits_subset=None,
        )

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        new_token_ids: list[list[int]] | torch.Tensor,
        prefix_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
        logits_rows: list[int],
        req_to_token_pool: ReqToTokenPool,
        kv_pool: HybridKVPool,
    ) -> ForwardBatch:
        """Lay out a batch from each request's new tokens and how many tokens it already has in KV.

        `new_token_ids`: each request's new tokens; or, for one new token per request, a [batch] tensor on the
        device (the previous step's sampled ids, never read back: an overlapped decode step is built while the
        step before it still runs). Building never waits for the device.
        """
        device = kv_pool.device
        on_device = isinstance(new_token_ids, torch.Tensor)
        extend_lens = [1] * len(new_token_ids) if on_device else [len(ids) for ids in new_token_ids]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        positions = [pos for p, s in zip(prefix_lens, seq_lens, strict=True) for pos in range(p, s)]
        flat_ids = [] if on_device else [tok for ids in new_token_ids for tok in ids]
        fields = (positions, req_pool_indices, seq_lens, prefix_lens, extend_lens, logits_rows, flat_ids)
        tensors = host_to_device(list(fields), device)
        input_ids = new_token_ids.to(torch.int64) if on_device else tensors[-1]
        return cls(
            mode=mode,
            input_ids=input_ids,
            positions=tensors[0],
            req_pool_indices=tensors[1],
            seq_lens=tensors[2],
            extend_prefix_lens=tensors[3],
            extend_seq_lens=tensors[4],
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            logits_rows=tensors[5],
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            req_pool_indices_cpu=list(req_pool_indices),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=extend_lens,
            logits_rows_cpu=list(logits_rows),
        )
