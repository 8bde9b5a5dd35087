"""A server whose scheduler or detokenizer dies says so: /health turns 503, requests get a clear 503 error,
and shutting it down still leaves no process behind. Its own server: the module-wide one of
test_serving_openai.py must stay healthy."""

from __future__ import annotations

import os
import signal
import time

import httpx
from serving_fixtures import PRESET, alive, child_pids, is_resource_tracker, start_server

DEATH_NOTICED_S = 30


def test_a_dead_child_turns_health_to_503_and_requests_to_clear_errors(tiny_checkpoint, tmp_path) -> None:
    model = tiny_checkpoint(PRESET)
    server = start_server(model, tmp_path / "server.log")
    children = [pid for pid in child_pids(server.proc.pid) if not is_resource_tracker(pid)]
    try:
        assert children, "no scheduler or detokenizer process found"
        os.kill(children[0], signal.SIGKILL)
        deadline = time.monotonic() + DEATH_NOTICED_S
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, f"/health still 200 {DEATH_NOTICED_S} s after a child died"
            time.sleep(0.2)
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": str(model), "prompt": "Hello", "max_tokens": 2},
            timeout=30,
        )
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["message"]
        assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 503
    finally:
        server.stop()
    deadline = time.monotonic() + 5
    while any(alive(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [child for child in children if alive(child)], "children outlived the server"
