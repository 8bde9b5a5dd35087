"""Compile Triton kernel variants in worker processes before a sweep times them one after another (bench/tune/).

Compiling hundreds of variants takes longer than timing them; workers that each launch a few variants once on
tiny inputs fill Triton's on-disk cache, from which the timing process then loads them.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from tqdm import tqdm


def precompile(worker: Callable[[Any, list], int], work: Sequence[tuple[Any, list]], jobs: int, chunk: int) -> None:
    """Run `worker(key, items)` (a module-level function: it is pickled) on chunks of `chunk` items of every
    (key, items) of `work`, in `jobs` spawned processes (CUDA forbids forking after its init). A worker that
    fails leaves its kernels to the timing process, which compiles them (or meets the same failure) itself."""
    tasks = [(key, items[i : i + chunk]) for key, items in work for i in range(0, len(items), chunk)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(worker, key, items): len(items) for key, items in tasks}
        with tqdm(total=sum(futures.values()), desc="compile", unit="kernel") as bar:
            for future in as_completed(futures):
                try:
                    future.result()
                except Exception as exc:
                    bar.write(f"compile worker failed: {type(exc).__name__}: {exc}")
                bar.update(futures[future])
