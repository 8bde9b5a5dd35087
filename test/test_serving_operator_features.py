"""What an operator sets or calls, on one real server: `--api-key`, `--chat-template`, /flush_cache,
/abort_request.

The key: the openai client with it is served, without it gets 401 (OpenAI's error shape,
`openai.AuthenticationError`); health checks and metrics stay open; the key never shows in /server_info. The
template: chat prompts and /tokenize render with it instead of the checkpoint's; a file that is missing or does
not parse stops the server's start. /flush_cache (and vLLM's /reset_prefix_cache) empties the prefix cache of an
idle server. /abort_request stops a request that another connection is waiting on: that response ends with
finish reason "abort"."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving_fixtures import PRESET, start_server, stop_and_check_no_child_left, wait_idle
from transformers import AutoTokenizer

from srt.server_args import ServerArgs

KEY = "sk-test-1234"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<model>"


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api-key")
    (folder / "template.jinja").write_text(TEMPLATE)
    args = ("--api-key", KEY, "--chat-template", str(folder / "template.jinja"))
    server = start_server(tiny_checkpoint(PRESET), folder / "server.log", *args)
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


def test_chat_prompts_render_with_the_given_template(server, tiny_checkpoint):
    messages = [{"role": "user", "content": "hi there"}]
    headers = {"Authorization": f"Bearer {KEY}"}
    got = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=headers, timeout=30).json()
    expected = AutoTokenizer.from_pretrained(tiny_checkpoint(PRESET)).encode(
        "<user> hi there\n<model>", add_special_tokens=False
    )
    assert got["tokens"] == expected
    name = str(client(server, KEY).models.list().data[0].id)
    reply = client(server, KEY).chat.completions.create(model=name, messages=messages, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == len(expected)


def test_an_empty_key_and_a_bad_template_are_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerArgs(model_path="m", api_key=" ")
    with pytest.raises(ValueError, match="chat_template must be a Jinja file's path or a Jinja template"):
        ServerArgs(model_path="m", chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match="chat_template does not parse"):
        ServerArgs(model_path="m", chat_template=str(tmp_path / "broken.jinja"))
    assert ServerArgs(model_path="m", chat_template=TEMPLATE).chat_template == TEMPLATE


def test_flush_cache_empties_the_prefix_cache_of_an_idle_server(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"text": "a prompt long enough to leave a cached prefix behind", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{server.url}/generate", json=body, headers=headers, timeout=60).status_code == 200
    cached = wait_idle(server.url, headers=headers)["pools"]["full"]["cached"]
    assert cached > 0
    flushed = httpx.post(f"{server.url}/flush_cache", headers=headers, timeout=30)
    assert flushed.status_code == 200 and flushed.json() == {"flushed_tokens": cached}
    pools = wait_idle(server.url, headers=headers)["pools"]
    assert all(pool["cached"] == 0 and pool["free"] == pool["total"] for pool in pools.values())
    again = httpx.post(f"{server.url}/reset_prefix_cache", headers=headers, timeout=30)
    assert again.status_code == 200 and again.json() == {"flushed_tokens": 0}


def aborted_while_running(server, body: dict, running: int) -> tuple[dict, list | dict]:
    """Send `body` to /generate, wait until `running` requests run, abort its rid from another connection:
    (/abort_request's answer, the generate call's own answer)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{server.url}/generate", json=body, headers=headers, timeout=120)
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/server_info", headers=headers, timeout=30).json()["num_running_reqs"] < running:
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.05)
        stopped = httpx.post(f"{server.url}/abort_request", json={"rid": body["rid"]}, headers=headers, timeout=30)
        assert stopped.status_code == 200
        return stopped.json(), waiting.result().json()


def test_abort_request_ends_another_connections_request(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"max_new_tokens": 400, "ignore_eos": True}
    stopped, result = aborted_while_running(server, {"text": "go on", "rid": "long", "sampling_params": long}, 1)
    assert stopped == {"aborted": ["long"]}
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["completion_tokens"] < 400  # what it had when stopped (0 if none was read yet)
    pair = {"text": "go on", "rid": "pair", "sampling_params": {**long, "n": 2}}
    stopped, results = aborted_while_running(server, pair, 2)
    assert sorted(stopped["aborted"]) == ["pair-0", "pair-1"]
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]
    none = httpx.post(f"{server.url}/abort_request", json={"abort_all": True}, headers=headers, timeout=30)
    assert none.json() == {"aborted": []}
    bad = httpx.post(f"{server.url}/abort_request", json={"rid": 5}, headers=headers, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
    wait_idle(server.url, headers=headers)
