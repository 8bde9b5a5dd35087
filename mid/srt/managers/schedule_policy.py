"""Which waiting requests to admit next, and how many of their tokens fit this step's budgets."""

from __future__ import annotations

from dataclasses import dataclass

from srt.managers.schedule_batch import Req
from srt.mem_cache.base_prefix_cache import PrefixCache


def order_waiting(waiting: list[Req], policy: str, cache: PrefixCache) -> list[Req]:
    """`fcfs`: arrival order. `lpm`: longest cached prefix first (ties keep arrival order), so requests
    sharing a prefix run while it is still cached."""
    if policy == "fcfs" or len(waiting) <= 1:
        return list(waiting)
    prefix_lens = {id(req): cache.match_prefix(req.cache_tokens(req.num_tokens - 1)).prefix_len for req in waiting}
    return sorted(waiting, key=lambda req: -prefix_lens[id(req)])


@dataclass
class PrefillBudget:
    """What is left of one step's limits while requests are being added to a prefill batch."""

    tokens: int  # prompt tokens left this step: --max-prefill-tokens and --chunked-prefill-size bound them
    chunk: int  # --chunked-prefill-size: the most tokens one request computes in one forward
    requests: int  # request rows left under --max-running-requests

    def fit(self, pending: int) -> int:
        """How many of `pending` tokens one request may compute in this forward (0: none)."""
        return min(pending, self.tokens, self.chunk)

    def take(self, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.requests -= 1
