"""Tensor parallelism behind the serving processes, on CPUs (gloo): two "nodes" of one rank each on loopback
give the tokens one rank gives alone, with chunked prefill, mixed batches and the radix cache at work; so does
one Engine with two ranks and the MTP assistant (its greedy tokens are the target's), and no process outlives
it; a rank that dies fails the requests with a clear error and leaves no process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from serving_fixtures import (
    CHILD_ENV,
    MODEL_ARGS,
    PRESET,
    alive,
    child_pids,
    greedy_reference,
    is_resource_tracker,
    reference_scheduler,
)

from srt import Engine
from srt.distributed.placement import free_loopback_address

NEW_TOKENS = 5
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SHARED = [2] + [(11 * i + 7) % 1000 for i in range(60)]  # longer than a chunk and the sliding window
PROMPTS = [
    [2, 5, 9, 200, 31],
    SHARED + [44, 45],
    [2] + [(29 * i + 3) % 1000 for i in range(90)],  # three chunks
    SHARED + [46],
]
# small chunks: the long prompts are computed over several steps while the short ones decode beside them
TP_ARGS = {**MODEL_ARGS, "chunked_prefill_size": 32, "log_level": "warning"}


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    return greedy_reference(reference_scheduler(model), PROMPTS, NEW_TOKENS)


@pytest.fixture(autouse=True)
def child_env(monkeypatch):
    for key, value in CHILD_ENV.items():
        monkeypatch.setenv(key, value)  # spawned children inherit it


def _started_children(before: set[int]) -> set[int]:
    return {pid for pid in child_pids(os.getpid()) - before if not is_resource_tracker(pid)}


def _assert_gone(pids: set[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "a process outlived the engine"


def _output_ids(engine: Engine) -> list[list[int]]:
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [out["output_ids"] for out in outputs]


def test_two_nodes_on_loopback(model, expected) -> None:
    address = free_loopback_address()
    node_args = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", address]
    same = {**TP_ARGS, "log_level": "warning"}  # every node gets the same arguments (rank 0 checks)
    model_args = [arg for key, value in same.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "srt.launch_server", "--model", str(model), "--node-rank", "1", *node_args,
         *model_args],
        env={**os.environ, **CHILD_ENV},
    )  # fmt: skip
    try:
        with Engine(model_path=str(model), tp_size=2, nnodes=2, node_rank=0, dist_init_addr=address, **TP_ARGS) as e:
            assert sorted(e._processes.children) == ["detokenizer", "scheduler"]
            assert _output_ids(e) == expected
            assert _output_ids(e) == expected  # again, from the radix cache's prefixes
            assert e.flush_cache() > 0  # every rank drops its cache at the same point: the same steps again
            assert _output_ids(e) == expected
        assert node1.wait(30) == 0  # node 1's rank ends with node 0's
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_dead_rank_fails_requests_clearly(model) -> None:
    before = child_pids(os.getpid())
    with Engine(model_path=str(model), tp_size=2, **TP_ARGS) as engine:
        started = _started_children(before)
        follower = engine._processes.children["scheduler-1"]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        with pytest.raises(RuntimeError, match="scheduler-1 process exited unexpectedly"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    _assert_gone(started, 15)


def test_mtp_with_two_ranks(model, expected, tiny_checkpoint) -> None:
    """The assistant's heads split as the target's: its layers read each rank's own KV heads; greedy outputs
    stay the target's own."""
    assistant = tiny_checkpoint(f"{PRESET}-assistant")
    before = child_pids(os.getpid())
    with Engine(model_path=str(model), tp_size=2, speculative_draft_model_path=str(assistant), **TP_ARGS) as engine:
        assert sorted(engine._processes.children) == ["detokenizer", "scheduler", "scheduler-1"]
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        started = _started_children(before)
    assert [out["output_ids"] for out in outputs] == expected
    assert sum(out["meta_info"]["spec_verify_ct"] for out in outputs) > 0
    _assert_gone(started, 10)


def test_an_engine_is_never_a_follower_node(model) -> None:
    with pytest.raises(ValueError, match="start it with launch_server"):
        Engine(model_path=str(model), tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1", **TP_ARGS)
