"""Request rows -> full-pool token slots.

Row r, column i holds the full-pool slot of token i of the request that owns row r. Attention backends
read a request's KV through this table, so a request's tokens need not sit in contiguous slots.
"""

from __future__ import annotations

import torch

from srt.forward.host_device import host_to_device


class ReqToTokenPool:
    """A [max_requests + 1, max_context] int32 table plus a free list of rows.

    The extra last row, `padding_row`, is never handed out and stays all zeros (slot 0, the allocators'
    padding slot): rows that only pad a batch to a captured CUDA-graph size point at it.
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str = "cpu") -> None:
        self.max_requests = max_requests
        self.max_context = max_context
        self.device = torch.device(device)
        self.padding_row = max_requests
        self.req_to_token = torch.zeros((max_requests + 1, max_context), dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = list(range(max_requests))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        """Take a free row; raises RuntimeError when every row is in use (callers check `available`)."""
        if not self._free_rows:
            raise RuntimeError("no free request rows: raise --max-running-requests or admit fewer requests")
        return self._free_rows.pop(0)

    def free(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.max_requests:
            raise ValueError(f"request row {row} is not in use")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` as the slots of tokens start .. start + len(slots) - 1 of the row's request."""
        self.req_to_token[row, start : start + len(slots)] = slots.to(torch.int32)

    def write_one_each(
        self, rows: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Record slot i as the slot of token positions[i] of row rows[i]'s request, in one op (a step's new
        tokens). `rows` and `positions` may already be on the device (a ForwardBatch's)."""
        if not isinstance(rows, torch.Tensor) or not isinstance(positions, torch.Tensor):
            rows, positions = host_to_device([list(rows), list(positions)], self.device)
        self.req_to_token[rows, positions] = slots.to(torch.int32)

    def in_use(self) -> int:
        return self.max_requests - len(self._free_rows)

    def check_integrity(self) -> None:
        rows = self._free_rows
        if len(set(rows)) != len(rows) or any(not 0 <= r < self.max_requests for r in rows):
            raise AssertionError(f"request-row free list is corrupt: {rows}")
        if self.req_to_token[self.padding_row].any():
            raise AssertionError("the padding row of req_to_token was written to")
