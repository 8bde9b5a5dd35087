"""A bounded soak: a few hundred mixed requests from concurrent clients, some cancelled mid-stream and some
abandoned by client timeouts, and afterwards: no 5xx, every request not abandoned answered, no KV slot in use,
server memory flat. The server runs what srt combines: a multimodal checkpoint with the MTP assistant drafting
(speculative verify steps beside prompt chunks in mixed batches), and the requests mix chats with images, tool
calls (auto, required, named) and JSON schemas in with the plain ones.

Seeded and sized for CI (SRT_SOAK_REQUESTS scales it; issue #29's manual run was 500). The same requests run
twice, and the RSS check compares the server's processes after the first round with after the second. Memory
that fills by content or by peak (image embeddings, compiled grammars, the allocators' high-water marks after
a long prompt with images and n = 2) is reached in the first round: read over one round, RSS grew anywhere from
-9 to +87 MB. A leak of per-request state (a request that is never forgotten holds its queue, its builder, its
logprobs, its image) grows again in the second round, which may grow at most RSS_GROWTH_MB.
"""

from __future__ import annotations

import base64
import io
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mm_fixtures import seeded_image
from serving_fixtures import PRESET, child_pids, start_server, wait_idle

from srt.tools.make_checkpoint import make_checkpoint

REQUESTS = int(os.environ.get("SRT_SOAK_REQUESTS", "80"))  # per round
CLIENTS = 8
RSS_GROWTH_MB = 48
WORDS = "the a city river weather number story time light house green small".split()


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak")
    model = make_checkpoint(PRESET, folder / "model", multimodal=True)
    assistant = tiny_checkpoint(f"{PRESET}-assistant")
    server = start_server(
        model, folder / "server.log", "--served-model-name", "soak", "--max-running-requests", "6",
        "--context-length", "2048", "--speculative-draft-model-path", str(assistant),
    )  # fmt: skip
    yield server
    server.stop()


def image_url(seed: int) -> str:
    buffer = io.BytesIO()
    seeded_image(48, 40, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_extras(rng: random.Random, prompt: str) -> dict:
    """What a chat request carries beside its text: an image, tools with a tool_choice, or a JSON schema."""
    kind = rng.random()
    if kind < 0.2:
        parts = [{"type": "image_url", "image_url": {"url": image_url(rng.randrange(1000))}}]
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]}
    if kind < 0.4:
        choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
        return {"tools": TOOLS, "tool_choice": choice}
    if kind < 0.6:
        schema = {"name": "weather", "schema": SCHEMA}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {}


def plan(seed: int, count: int) -> list[dict]:
    """What each request does: route, body, and whether the client cancels or times out."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
        tokens = rng.randint(1, 24)
        sampling = {"temperature": rng.choice([0.0, 0.7, 1.0]), "n": rng.choice([1, 1, 2])}
        if rng.random() < 0.3:
            sampling["stop"] = [rng.choice(WORDS)]
        if rng.random() < 0.2:
            sampling["seed"] = rng.randint(0, 2**64 - 1)
        route = rng.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
        if route == "/generate":
            params = {"max_new_tokens": tokens, **sampling}
            params.pop("n") if params["n"] == 1 else None
            body = {"text": prompt, "sampling_params": params}
        elif route == "/v1/completions":
            body = {"model": "soak", "prompt": prompt, "max_tokens": tokens, **sampling}
        else:
            messages = [{"role": "user", "content": prompt}]
            body = {"model": "soak", "messages": messages, "max_tokens": tokens, **sampling}
            body.update(chat_extras(rng, prompt))
        stream = rng.random() < 0.5
        body["stream"] = stream
        fate = rng.random()
        action = "cancel" if stream and fate < 0.4 else "timeout" if fate > 0.95 else "finish"
        requests.append({"i": i, "route": route, "body": body, "action": action})
    return requests


def send(url: str, request: dict) -> tuple[str, int | None]:
    """('answered' | 'cancelled' | 'timed_out', HTTP status)."""
    timeout = httpx.Timeout(120, read=0.05) if request["action"] == "timeout" else httpx.Timeout(120)
    try:
        with httpx.stream("POST", url + request["route"], json=request["body"], timeout=timeout) as response:
            if request["action"] == "cancel" and response.status_code == 200:
                for n, _ in enumerate(response.iter_lines()):
                    if n == 2:
                        return "cancelled", response.status_code  # leaving closes the connection mid-stream
            text = "".join(response.iter_text())
            if request["body"]["stream"] and response.status_code == 200:
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            return "answered", response.status_code
    except httpx.ReadTimeout:
        return "timed_out", None


def rss_mb(pid: int) -> float:
    """Resident memory of the server and its children (the scheduler, the detokenizer)."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def run(url: str, requests: list[dict]) -> list[tuple[str, int | None]]:
    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(lambda r: send(url, r), requests))


def test_soak_mixed_requests_cancellations_and_timeouts(server):
    requests = plan(seed=29, count=REQUESTS)
    outcomes = run(server.url, requests)  # also the warm-up of the allocators, caches and Triton's interpreter
    wait_idle(server.url)
    middle = rss_mb(server.proc.pid)
    outcomes += run(server.url, requests)  # the same requests again: the same peaks, the same cache contents
    info = wait_idle(server.url)
    after = rss_mb(server.proc.pid)
    requests = requests * 2

    statuses = [status for _, status in outcomes if status is not None]
    assert all(status < 500 for status in statuses), sorted(set(statuses))
    refused = [(r["body"], s) for r, (_, s) in zip(requests, outcomes) if s not in (None, 200)]
    assert not refused, refused
    finished = [r for r, (how, _) in zip(requests, outcomes) if r["action"] == "finish"]
    assert all(how == "answered" for r, (how, _) in zip(requests, outcomes) if r["action"] == "finish")
    kinds = {action: sum(r["action"] == action for r in requests) for action in ("finish", "cancel", "timeout")}
    print(
        f"soak: {len(requests)} requests {kinds}, {len(finished)} answered; RSS after the first round "
        f"{middle:.0f} MB, after the second {after:.0f} MB; generated {info['generated_tokens_total']} tokens"
    )
    assert kinds["cancel"] and kinds["timeout"]  # the plan exercises both
    chats = [r["body"] for r in requests if r["route"] == "/v1/chat/completions"]
    assert all(any(key in body for body in chats) for key in ("tools", "response_format")), "the plan's chat mix"
    assert any(isinstance(body["messages"][0]["content"], list) for body in chats), "no chat carried an image"
    metrics = httpx.get(f"{server.url}/metrics").text
    rounds = [line for line in metrics.splitlines() if line.startswith("srt_spec_accept_length_count")]
    assert rounds and float(rounds[0].split()[-1]) > 0, "the assistant verified no drafts"
    assert after - middle < RSS_GROWTH_MB
    assert httpx.get(f"{server.url}/health").status_code == 200
