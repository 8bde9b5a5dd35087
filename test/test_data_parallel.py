"""Data-parallel replicas (--dp-size): where each scheduler runs and which requests go where, and an Engine with
two replicas on CPUs giving one replica's tokens, with both replicas used and nothing left in use after a stop
string's abort or a stream closed early."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from serving_fixtures import CHILD_ENV
from test_tensor_parallel_serving import GREEDY, PROMPTS, TP_ARGS, expected, model  # noqa: F401 (fixtures)

from srt import Engine
from srt.distributed.placement import RankPlace
from srt.entrypoints.processes import _children
from srt.managers.ipc import PortArgs
from srt.managers.replica_router import ReplicaRouter
from srt.server_args import ServerArgs


def test_the_least_loaded_replica_takes_each_request_and_ties_go_round() -> None:
    router = ReplicaRouter(3)
    assert [router.route(f"r{i}") for i in range(3)] == [0, 1, 2]
    assert router.release("r1") == 1 and router.route("r3") == 1  # the only replica with none in flight
    assert router.release("r3") == 1 and router.release("unknown") is None
    for rid in ("r0", "r2"):
        router.release(rid)
    # one request at a time: each goes to a different replica in turn
    singles = []
    for i in range(3):
        singles.append(router.route(f"s{i}"))
        router.release(f"s{i}")
    assert sorted(singles) == [0, 1, 2] and router.in_flight == [0, 0, 0]


def test_each_replica_has_its_gpus_its_input_and_its_store(tmp_path) -> None:
    args = ServerArgs(model_path="m", dp_size=2, tp_size=2, base_gpu_id=1)
    ports = PortArgs.create(2)
    try:
        children = _children(args, ports)
    finally:
        ports.cleanup()
    names = [child[0] for child in children]
    assert names == ["scheduler", "scheduler-1", "scheduler-dp1", "scheduler-dp1-1", "detokenizer"]
    places: list[RankPlace] = [child[4][0] for child in children[:4]]
    assert [place.gpu(args) for place in places] == [1, 2, 3, 4]
    inputs = [child[3].scheduler_input for child in children[:4]]
    assert inputs[0] == inputs[1] != inputs[2] == inputs[3] and list(ports.replica_inputs) == [inputs[0], inputs[2]]
    stores = [child[2].dist_init_addr for child in children[:4]]
    assert stores[0] == stores[1] != stores[2] == stores[3]
    given = ServerArgs(model_path="m", dp_size=2, tp_size=2, dist_init_addr="10.0.0.1:5000")
    ports = PortArgs.create(2)
    try:
        assert [child[2].dist_init_addr for child in _children(given, ports)[:4:2]] == [
            "10.0.0.1:5000",
            "10.0.0.1:5001",
        ]
    finally:
        ports.cleanup()


def test_start_up_refuses_replicas_it_cannot_place() -> None:
    from srt.distributed.ranks import rank_device

    args = ServerArgs(model_path="m", device="cuda", dp_size=2, tp_size=torch.cuda.device_count() + 1)
    needed = 2 * args.tp_size
    with pytest.raises(RuntimeError, match=rf"--dp-size 2 x --tp-size {args.tp_size} .* needs GPUs 0\.\.{needed - 1}"):
        rank_device(args, RankPlace(0, args.tp_size, 0, 1))
    for bad, phrase in (({"dp_size": 0}, "dp_size must be >= 1"), ({"dp_size": 2, "nnodes": 2}, "one node")):
        with pytest.raises(ValueError, match=phrase):
            ServerArgs(model_path="m", dist_init_addr="h:1", tp_size=2, **bad)


def test_two_replicas_give_one_replicas_tokens(model, expected, monkeypatch) -> None:  # noqa: F811
    for key, value in CHILD_ENV.items():
        monkeypatch.setenv(key, value)  # spawned children inherit it
    with Engine(model_path=str(model), dp_size=2, **TP_ARGS) as engine:
        assert sorted(engine._processes.children) == ["detokenizer", "scheduler", "scheduler-dp1"]
        outputs = engine.generate(input_ids=PROMPTS + PROMPTS, sampling_params=GREEDY)
        assert [out["output_ids"] for out in outputs] == expected + expected
        # a stop string and a stream closed early: each abort reaches the replica that runs the request, which
        # stops within a few steps instead of running on to 400 tokens
        before = engine.get_server_info()["generated_tokens_total"]
        stopped = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 400, "stop": ["a", "e"]})
        assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
        stream = engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 400}, stream=True)
        next(stream)
        stream.close()
        info = _when_idle(engine)
        assert info["generated_tokens_total"] - before < 100
        replicas = info["replicas"]
        assert all(r["num_running"] == r["num_waiting"] == 0 for r in replicas), replicas
        assert all(pool["in_use"] == 0 for r in replicas for pool in r["pools"].values()), replicas
        assert all(r["generated_tokens_total"] > 0 for r in replicas)  # both served requests
        assert info["generated_tokens_total"] == sum(r["generated_tokens_total"] for r in replicas)
        assert info["pools"]["full"]["total"] == 2 * replicas[0]["pools"]["full"]["total"]


def _when_idle(engine: Engine, timeout: float = 30.0) -> dict:
    """Server info once no replica runs a request or holds a KV slot (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        idle = all(r["num_running"] == 0 and r["pools"]["full"]["in_use"] == 0 for r in info["replicas"])
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_replicas_on_two_gpus(model, monkeypatch) -> None:  # noqa: F811
    """Each replica on its own GPU (fp32, the GPU's kernels and graphs): the tokens of one GPU alone."""
    from serving_fixtures import greedy_reference, reference_scheduler

    gpu = {"device": "cuda", "dtype": "float32"}
    # a small pool, released before the replicas start: by default it would take GPU 0's memory from replica 0
    reference = reference_scheduler(model, **gpu, max_total_tokens=2048)
    expected_gpu = greedy_reference(reference, PROMPTS, GREEDY["max_new_tokens"])
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    for key, value in CHILD_ENV.items():
        monkeypatch.setenv(key, value)
    with Engine(model_path=str(model), dp_size=2, **{**TP_ARGS, **gpu}) as engine:
        outputs = engine.generate(input_ids=PROMPTS + PROMPTS, sampling_params=GREEDY)
        assert [out["output_ids"] for out in outputs] == expected_gpu + expected_gpu
        assert all(r["generated_tokens_total"] > 0 for r in _when_idle(engine)["replicas"])
