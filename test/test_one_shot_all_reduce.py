"""The one-shot all-reduce in symmetric memory (`srt/distributed/one_shot.py`) on two GPUs: the sums of decode-size
messages equal NCCL's exactly (a two-term float sum does not depend on the order), eagerly and replayed from a
CUDA graph with new inputs; messages it does not fit go to NCCL. Marked gpu; needs two CUDA devices."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from srt.distributed.placement import RankPlace, free_loopback_address
from srt.server_args import ServerArgs

HIDDEN = 5376  # 31B's hidden size
ROWS = (1, 8, 32)


def _rank_main(address: str, rank: int, results: mp.Queue) -> None:
    import torch.distributed as dist

    from srt.distributed.collectives import reduce_sum
    from srt.distributed.ranks import TensorParallelGroup

    args = ServerArgs(model_path=".", device="cuda", tp_size=2, dist_init_addr=address)
    group = TensorParallelGroup(args, RankPlace(rank, 2, rank))
    failures = [] if group.one_shot else ["no one-shot all-reduce was installed (its warning says why)"]
    generator = torch.Generator(device="cuda").manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, dtype=dtype, device="cuda", generator=generator)
            expected = x.clone()
            dist.all_reduce(expected)
            if not torch.equal(reduce_sum(x.clone(), 2), expected):
                failures.append(f"eager {dtype} [{rows}, {HIDDEN}]")
    static = torch.zeros(32, HIDDEN, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = reduce_sum(static, 2)
    for step in range(3):
        static.copy_(torch.randn(32, HIDDEN, device="cuda", generator=generator))
        expected = static.clone()
        dist.all_reduce(expected)
        graph.replay()
        if not torch.equal(total, expected):
            failures.append(f"graph replay {step}")
    odd = torch.randn(3, 5, device="cuda", generator=generator)  # 60 bytes: not the kernel's 16-byte multiple
    expected = odd.clone()
    dist.all_reduce(expected)
    if not torch.equal(reduce_sum(odd.clone(), 2), expected):
        failures.append("a message left to NCCL")
    torch.cuda.synchronize()
    results.put((rank, failures))


@pytest.mark.gpu
def test_one_shot_sums_equal_nccl_eagerly_and_in_graphs() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    address = free_loopback_address()
    procs = [ctx.Process(target=_rank_main, args=(address, r, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    failures = dict(results.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert failures == {0: [], 1: []}
