"""A server with the MTP assistant: /generate gives the greedy tokens of a server without it, reports verify
rounds and accepted drafts in meta_info, and /metrics shows the accept-length histogram."""

from __future__ import annotations

import httpx
import pytest
from serving_fixtures import PRESET, greedy_reference, reference_scheduler, start_server
from test_bench_serving import run_bench
from test_metrics import samples
from torch_threads import one_torch_thread

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    assistant = tiny_checkpoint(f"{PRESET}-assistant")
    log = tmp_path_factory.mktemp("mtp-server") / "server.log"
    server = start_server(tiny_checkpoint(PRESET), log, "--speculative-draft-model-path", str(assistant))
    yield server
    server.stop()


def test_generate_with_mtp_matches_the_target_alone(server, tiny_checkpoint) -> None:
    prompts = [[2, 17, 300, 41, 9], [2, 5, 6, 7, 8, 9, 10, 11, 12]]
    with one_torch_thread():  # as the server's scheduler: the same float summation order
        expected = greedy_reference(reference_scheduler(tiny_checkpoint(PRESET)), prompts, NEW_TOKENS)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    response = httpx.post(f"{server.url}/generate", json={"input_ids": prompts, "sampling_params": params}, timeout=60)
    assert response.status_code == 200, response.text
    results = response.json()
    assert [r["output_ids"] for r in results] == expected
    for result in results:
        meta = result["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_verify_ct"] + meta["spec_accepted_tokens"] == NEW_TOKENS - 1  # the first: the prefill
    metrics = samples(httpx.get(f"{server.url}/metrics", timeout=30).content)
    model = (("model_name", str(tiny_checkpoint(PRESET))),)
    rounds = metrics["srt_spec_accept_length_count", model]
    assert rounds >= sum(result["meta_info"]["spec_verify_ct"] for result in results)
    assert metrics["srt_spec_accept_length_mean", model] >= 1.0


def test_bench_serving_runs_against_an_mtp_server(server, tmp_path) -> None:
    """#23's `bench_serving` with MTP: every request completes with exactly the asked tokens, counted by their
    logprobs (a verify round can stream several tokens in one chunk)."""
    report = run_bench(
        server.url, tmp_path / "mtp.json", "--num-prompts", "4", "--random-input-len", "12",
        "--random-output-len", "6", "--max-concurrency", "2", "--stream-logprobs",
    )  # fmt: skip
    metrics = report["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (4, 0, 24)
    assert metrics["tokens_per_chunk"] >= 1.0
    assert all(record["output_tokens"] == 6 for record in report["requests"])
