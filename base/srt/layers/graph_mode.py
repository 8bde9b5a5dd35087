"""Whether the running forward is a CUDA-graph step (its warm-up or its capture), for kernels that choose.

Some ops pick among kernels by what is cheapest eagerly (fewer launches) or inside a graph (launches are
free). The graph runner runs a step's warm-up and its capture inside `cuda_graph_step()`, so both choose the
same kernels: the warm-up then compiles exactly what the capture records.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_in_graph_step: ContextVar[bool] = ContextVar("srt_in_cuda_graph_step", default=False)


@contextmanager
def cuda_graph_step() -> Iterator[None]:
    token = _in_graph_step.set(True)
    try:
        yield
    finally:
        _in_graph_step.reset(token)


def in_cuda_graph_step() -> bool:
    return _in_graph_step.get()
