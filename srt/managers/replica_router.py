"""Which data-parallel replica (--dp-size) serves a request: the one with the fewest requests in flight.

The tokenizer manager counts its own requests per replica (sent, not yet finished, failed or aborted): no
message to the schedulers is needed to decide. Ties go round the replicas, so a trickle of one request at a
time still uses them all. A request's aborts go where the request went.
"""

from __future__ import annotations

import itertools


class ReplicaRouter:
    """Requests in flight per replica, and where each one went."""

    def __init__(self, num_replicas: int) -> None:
        self.in_flight = [0] * num_replicas
        self._replica_of: dict[str, int] = {}
        self._next_first = itertools.cycle(range(num_replicas))

    def route(self, rid: str) -> int:
        """The replica for a new request `rid`, counted as in flight there."""
        first = next(self._next_first)
        order = [*range(first, len(self.in_flight)), *range(first)]
        replica = min(order, key=self.in_flight.__getitem__)
        self.in_flight[replica] += 1
        self._replica_of[rid] = replica
        return replica

    def replica_of(self, rid: str) -> int | None:
        """Where `rid` is in flight; None if it is not."""
        return self._replica_of.get(rid)

    def release(self, rid: str) -> int | None:
        """`rid` left its replica (finished, failed or aborted); the replica it was on, None if unknown."""
        replica = self._replica_of.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1
        return replica

    def clear(self) -> None:
        self._replica_of.clear()
        self.in_flight = [0] * len(self.in_flight)
