"""`--api-key` on a real server: the openai client with the key is served, without it gets 401 (OpenAI's error
shape, `openai.AuthenticationError`); health checks and metrics stay open; the key never shows in /server_info."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving_fixtures import PRESET, start_server, stop_and_check_no_child_left

from srt.server_args import ServerArgs

KEY = "sk-test-1234"


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-key") / "server.log"
    server = start_server(tiny_checkpoint(PRESET), log, "--api-key", KEY)
    yield server
    stop_and_check_no_child_left(server)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_key_is_required_on_every_route_but_health_and_metrics(server):
    name = str(client(server, KEY).models.list().data[0].id)
    out = client(server, KEY).completions.create(model=name, prompt="hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens <= 2
    with pytest.raises(openai.AuthenticationError) as refused:
        client(server, "sk-wrong").chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    for method, path in (("get", "/v1/models"), ("post", "/generate"), ("get", "/server_info"), ("post", "/tokenize")):
        response = httpx.request(method, f"{server.url}{path}", json={"text": "hi"}, timeout=30)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 200, path
    info = httpx.get(f"{server.url}/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert info["server_args"]["api_key"] is None


def test_an_empty_key_is_refused_at_start():
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerArgs(model_path="m", api_key=" ")
