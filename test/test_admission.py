"""Admission control under overload (issue #29, item 2), against a real server with --max-running-requests 4,
the default --max-queued-requests (16) and --request-timeout 2:

- a burst of 300 requests at once: every one answered, 200 or 429 with Retry-After (never a 5xx, never
  silence), no KV slot in use afterwards, server memory flat over a second burst;
- a full server: /health says "overloaded" (still 200), the next request is refused at once (429
  queue_full); streams waiting in the queue have their headers already; requests that wait past
  --request-timeout are dropped and answered (429 queue_timeout, or an error event in a stream) while the
  running ones finish; the metrics count both;
- a stream the client leaves counts as an abort in srt_requests_total; /openapi.json documents the 429.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import httpx
import pytest
from serving_fixtures import PRESET, start_server
from test_soak import rss_mb, wait_idle

from srt.managers.admission import Admission, Overloaded
from srt.server_args import ServerArgs

MAX_RUNNING = 4
MAX_QUEUED = 16  # the default: 4 x --max-running-requests
# Long enough to fill the queue before the first queued request times out, short enough that all of them time
# out while the blockers still run (~4 s): both with room on a loaded machine.
REQUEST_TIMEOUT_S = 2.0
BURST = 300
RSS_GROWTH_MB = 64
# a request that runs ~4 s in a batch of four on the CI machine: long past REQUEST_TIMEOUT_S
BLOCKER = {"text": "hello", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("admission") / "server.log"
    args = ["--served-model-name", "m", "--max-running-requests", str(MAX_RUNNING)]
    server = start_server(tiny_checkpoint(PRESET), log, *args, "--request-timeout", str(REQUEST_TIMEOUT_S))
    yield server
    server.stop()


def burst_request(i: int) -> tuple[str, dict]:
    stream = i % 2 == 1
    if i % 3 == 0:
        return "/generate", {"text": f"burst {i}", "sampling_params": {"max_new_tokens": 8}, "stream": stream}
    if i % 3 == 1:
        return "/v1/completions", {"model": "m", "prompt": f"burst {i}", "max_tokens": 8, "stream": stream}
    messages = [{"role": "user", "content": f"burst {i}"}]
    return "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 8, "stream": stream}


async def send(client: httpx.AsyncClient, route: str, body: dict) -> tuple[int, str | None, float]:
    """(status, the 429's error code, seconds); asserts that a 200 stream ends with [DONE]."""
    start = time.monotonic()
    async with client.stream("POST", route, json=body) as response:
        text = (await response.aread()).decode()
    if response.status_code == 429:
        assert int(response.headers["retry-after"]) >= 1
        return 429, json.loads(text)["error"]["code"], time.monotonic() - start
    if response.status_code == 200 and body["stream"]:
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    return response.status_code, None, time.monotonic() - start


async def burst(url: str) -> list[tuple[int, str | None, float]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        return await asyncio.gather(*(send(client, *burst_request(i)) for i in range(BURST)))


def metric(url: str, series: str) -> float:
    """The value of the /metrics line that starts with `series` (0 before it is first counted)."""
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(series)]
    return float(lines[0].split()[-1]) if lines else 0.0


REJECTED = "srt_requests_rejected_total{"
TIMED_OUT = 'srt_requests_total{model_name="m",reason="queue_timeout"}'


def test_a_burst_of_300_is_answered_200_or_429_and_leaves_nothing_behind(server):
    asyncio.run(burst(server.url))  # warm-up: allocator, caches, Triton's interpreter, uvicorn's buffers
    wait_idle(server.url)
    before, rejected_before = rss_mb(server.proc.pid), metric(server.url, REJECTED)
    outcomes = asyncio.run(burst(server.url))
    wait_idle(server.url)
    after = rss_mb(server.proc.pid)

    statuses = Counter(status for status, _, _ in outcomes)
    codes = Counter(code for _, code, _ in outcomes if code)
    served = [seconds for status, _, seconds in outcomes if status == 200]
    print(f"burst: {BURST} requests -> {dict(statuses)}, 429s {dict(codes)}; slowest 200 {max(served):.2f} s; "
          f"RSS {before:.0f} -> {after:.0f} MB")  # fmt: skip
    assert set(statuses) <= {200, 429}, statuses
    assert MAX_RUNNING <= statuses[200] and statuses[429] >= BURST - MAX_RUNNING - MAX_QUEUED - statuses[200]
    assert set(codes) <= {"queue_full", "queue_timeout"}
    assert metric(server.url, REJECTED) - rejected_before == codes["queue_full"]
    assert after - before < RSS_GROWTH_MB
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


class Background(threading.Thread):
    """One request sent from a thread; `status` and `text` once it is answered."""

    def __init__(self, url: str, route: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.route, self.body = url, route, body
        self.status: int | None = None
        self.text = ""
        self.start()

    def run(self) -> None:
        response = httpx.post(self.url + self.route, json=self.body, timeout=120)
        self.status, self.text = response.status_code, response.text


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def test_a_full_server_refuses_at_once_and_times_out_what_waits_too_long(server):
    wait_idle(server.url)
    timed_out_before = metric(server.url, TIMED_OUT)
    blockers = [Background(server.url, "/generate", BLOCKER) for _ in range(MAX_RUNNING)]
    wait_for(lambda: httpx.get(f"{server.url}/server_info").json()["num_running_reqs"] == MAX_RUNNING, "running")
    body = {"model": "m", "prompt": "queued", "max_tokens": 4}
    fill_start = time.monotonic()
    queued = [Background(server.url, "/v1/completions", body) for _ in range(MAX_QUEUED - 1)]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200  # headers while it waits behind the blockers
        health = lambda: httpx.get(f"{server.url}/health").json()  # noqa: E731
        wait_for(lambda: health()["in_flight"] == MAX_RUNNING + MAX_QUEUED, "queue full", REQUEST_TIMEOUT_S)
        assert health()["status"] == "overloaded"
        print(f"queue filled in {time.monotonic() - fill_start:.2f} s")
        chat = {"model": "m", "messages": [{"role": "user", "content": "refused"}], "max_tokens": 4}
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=10)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "queue_full" and refused.json()["error"]["message"]
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "queue_timeout", events
    for request in queued:
        request.join(30)
        assert request.status == 429 and json.loads(request.text)["error"]["code"] == "queue_timeout", request.text
    for blocker in blockers:
        blocker.join(60)
        assert blocker.status == 200, blocker.text
    timed_out = metric(server.url, TIMED_OUT) - timed_out_before
    assert timed_out == MAX_QUEUED
    wait_idle(server.url)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_stream_the_client_leaves_counts_as_an_abort_and_frees_its_slots(server):
    wait_idle(server.url)
    aborted = 'srt_requests_total{model_name="m",reason="abort"}'
    before = metric(server.url, aborted)
    with httpx.stream("POST", f"{server.url}/generate", json={**BLOCKER, "stream": True}, timeout=60) as response:
        next(response.iter_lines())  # the first event: the request runs; leaving closes the connection
    wait_for(lambda: metric(server.url, aborted) == before + 1, "the abort counted")
    wait_idle(server.url)


def test_openapi_documents_the_429_of_generation_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert "429" in paths[path]["post"]["responses"], path
    assert "429" not in paths["/tokenize"]["post"]["responses"]


def test_admission_counts_samples_and_tickets_give_back_once():
    admission = Admission(ServerArgs(max_running_requests=2, max_queued_requests=3))
    assert admission.limit == 5 and not admission.full
    pair = admission.admit(2)  # a request with n=2
    three = admission.admit(3)
    assert (admission.in_flight, admission.queued, admission.full) == (5, 3, True)
    with pytest.raises(Overloaded) as refused:
        admission.check()
    assert refused.value.code == "queue_full" and refused.value.retry_after == 1
    pair.release()
    pair.release()  # a stream's response and its generator may both give it back
    assert (admission.in_flight, admission.queued) == (3, 1)
    admission.admit(2)
    three.release()
    assert admission.in_flight == 2
    with pytest.raises(ValueError, match="n must be at most 5"):
        admission.check(6)  # could never fit: a 400, not a 429 the client would retry forever


def test_the_default_queue_is_four_batches_and_flags_are_checked():
    assert Admission(ServerArgs(max_running_requests=4)).limit == 4 + 16
    assert Admission(ServerArgs(max_running_requests=3, max_queued_requests=0)).limit == 3
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerArgs(max_queued_requests=-1)
    with pytest.raises(ValueError, match="request_timeout"):
        ServerArgs(request_timeout=0)
