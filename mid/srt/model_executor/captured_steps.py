"""The machinery of captured steps: static inputs, one CUDA graph per batch size, the batch sizes to capture.

`CapturedSteps` captures a step function once per batch size (largest first, in a shared memory pool) and
replays the graph of the smallest captured size that holds a batch; `StaticInputs` holds the buffers a
captured step reads, filled before each replay. `cuda_graph_runner.py` builds the decode step and YOCO's
KV-shared layers on them.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from srt.layers.graph_mode import cuda_graph_step

logger = logging.getLogger(__name__)

StepOutput = TypeVar("StepOutput")


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_batch_size` (which is always included)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch_size]
    sizes += range(16, max_batch_size, 8)
    return [*sizes, max_batch_size]


class StaticInputs:
    """The captured step's inputs, `max_rows` rows each; `load` fills rows past the batch's own with padding.

    The per-row ids (positions, request rows, lengths, ...) share one int64 buffer, one row per input, so a
    batch's ids go in with one stack and one copy: the GPU idles while the host issues them before a replay,
    and five copies cost 0.05-0.09 ms of an E4B decode step on an H100 (docs/benchmarks.md). Other inputs
    (hidden states) get a buffer each (`add`).
    """

    def __init__(self, max_rows: int, device: torch.device, id_paddings: dict[str, int]) -> None:
        self.max_rows = max_rows
        self.device = device
        self.id_names = list(id_paddings)
        self.ids = torch.tensor(list(id_paddings.values()), dtype=torch.int64, device=device)
        self.ids = self.ids[:, None].repeat(1, max_rows)
        self.id_padding = self.ids.clone()
        self.host_padding = list(id_paddings.values())
        self.buffers: dict[str, torch.Tensor] = {}
        self.padding: dict[str, int | float] = {}

    @property
    def names(self) -> list[str]:
        return [*self.id_names, *self.buffers]

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, padding: int | float) -> None:
        self.buffers[name] = torch.full((self.max_rows, *shape), padding, dtype=dtype, device=self.device)
        self.padding[name] = padding

    def load(self, values: dict[str, torch.Tensor], num_rows: int, padded_rows: int) -> None:
        # each op costs host time before the replay can launch
        self.ids[:, :num_rows].copy_(torch.stack([values[name] for name in self.id_names]))
        if padded_rows > num_rows:
            self.ids[:, num_rows:padded_rows].copy_(self.id_padding[:, num_rows:padded_rows])
        for name, buffer in self.buffers.items():
            buffer[:num_rows].copy_(values[name])
            if padded_rows > num_rows:
                buffer[num_rows:padded_rows].fill_(self.padding[name])

    def padded_host_rows(self, values: dict[str, list[int]], padded_rows: int) -> list[int]:
        """The id rows of `values` padded to `padded_rows`, one after the other."""
        num_rows = len(values[self.id_names[0]])
        flat = []
        for name, pad in zip(self.id_names, self.host_padding, strict=True):
            flat += values[name]
            flat += [pad] * (padded_rows - num_rows)
        return flat

    def view(self, num_rows: int) -> dict[str, torch.Tensor]:
        ids = {name: self.ids[i, :num_rows] for i, name in enumerate(self.id_names)}
        return ids | {name: buffer[:num_rows] for name, buffer in self.buffers.items()}


def load_host_lists(loads: list[tuple[StaticInputs, dict[str, list[int]], int]]) -> None:
    """Fill the id rows of several inputs from host lists (each input's values, padded to its padded rows) out of
    one pinned host tensor: each `torch.tensor` of a list costs the host tens of microseconds before a replay."""
    flat, starts = [], []
    for inputs, values, padded_rows in loads:
        starts.append(len(flat))
        flat += inputs.padded_host_rows(values, padded_rows)
    device = loads[0][0].device
    host = torch.tensor(flat, dtype=torch.int64, pin_memory=device.type == "cuda")
    for (inputs, _, padded_rows), start in zip(loads, starts, strict=True):
        size = len(inputs.id_names) * padded_rows
        rows = host[start : start + size].view(len(inputs.id_names), padded_rows)
        inputs.ids[:, :padded_rows].copy_(rows, non_blocking=True)  # the caching host allocator keeps `host` alive


class CapturedSteps(Generic[StepOutput]):
    """`step(batch_size)` captured as one CUDA graph per batch size (or run eagerly when not `use_graphs`)."""

    def __init__(
        self,
        step: Callable[[int], StepOutput],
        batch_sizes: list[int],
        use_graphs: bool,
        pool: tuple | None = None,
        name: str = "step",
    ) -> None:
        self.step = step
        self.batch_sizes = sorted(set(batch_sizes))
        self.use_graphs = use_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, StepOutput] = {}
        if use_graphs:
            self._capture_all(pool, name)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, num_rows: int) -> int:
        """The smallest captured batch size that holds `num_rows` rows."""
        if not 0 < num_rows <= self.max_batch_size:
            raise ValueError(f"{num_rows} rows: captured batch sizes go up to {self.max_batch_size}")
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_rows)]

    def run(self, batch_size: int) -> StepOutput:
        if not self.use_graphs:
            return self.step(batch_size)
        self.graphs[batch_size].replay()
        return self.outputs[batch_size]

    @torch.no_grad()
    def _capture_all(self, pool: tuple | None, name: str) -> None:
        # Python's garbage collector must not run mid-capture: freeing a dead runner's CUDA graphs there
        # (cudaGraphExecDestroy) is not allowed while a stream captures, and it invalidates the capture
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_each(pool, name)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _capture_each(self, pool: tuple | None, name: str) -> None:
        start = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved()
        # largest first: the smaller graphs then fit in memory the shared pool already holds
        for batch_size in reversed(self.batch_sizes):
            with cuda_graph_step():  # warm-up and capture choose the same kernels
                for _ in range(2):  # warm-up: Triton compiles its kernels, backends make their lazy tables
                    self.step(batch_size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch_size] = self.step(batch_size)
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        used = (torch.cuda.memory_reserved() - reserved_before) / 2**30
        logger.info(
            "CUDA graphs of %s captured for batch sizes %s in %.1f s (%.2f GiB)",
            name,
            self.batch_sizes,
            time.perf_counter() - start,
            used,
        )
