"""One torch thread for a block: tiny matmuls gain nothing from threads (on a busy 2-core machine OpenMP
spin-waits make them 100x slower), and a reference computed in the test process sums floats in the order of
the server's scheduler process, which runs one thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
