"""Requests generated from the server's own OpenAPI document (every POST body), valid and mutated, never get a
5xx, never hang, never leak a KV slot, and `/health` keeps answering between them.

Bodies come from the documented schemas (openapi_strategies); a mutated body replaces one field with any
JSON value (huge integers, floats, lone surrogates, nesting) or is written as raw JSON text with literals
Python's encoder would not produce (NaN, Infinity, 1e999). Seeded and bounded (`derandomize`, max_examples), so
CI runs the same few hundred requests every time; SRT_FUZZ_EXAMPLES scales it up for a long run.
"""

from __future__ import annotations

import collections
import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_strategies import from_schema
from serving_fixtures import wait_idle

EXAMPLES = int(os.environ.get("SRT_FUZZ_EXAMPLES", "60"))  # per route: 300 requests in CI
MAX_GENERATED_TOKENS = 4  # bodies ask for short outputs: the fuzzer looks for bad answers, not long ones
TIMEOUT = 60
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's server (conftest.py); this module leaves it idle with no slot leaked."""
    yield shared_server
    wait_idle(shared_server.url)


@pytest.fixture(scope="module")
def document(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT).json()


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2, max_value=2**65)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    | st.sampled_from(["\ud800", "a\udfffb", "<bos>", ""]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
bad_literal = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[" * 300 + "]" * 300])


# A request that passes validation, per route: drawn fields are laid over it, so most bodies get past the
# first check and reach tokenization, sampling and the scheduler.
def bases(name: str) -> dict[str, dict]:
    """Per route, a valid body for the served model `name`."""
    return {
        "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
        "/v1/completions": {"model": name, "prompt": "Hello", "max_tokens": 4},
        "/v1/chat/completions": {"model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        "/tokenize": {"prompt": "Hello"},
        "/detokenize": {"tokens": [2, 5, 9]},
    }


def body_strategy(document: dict, path: str, name: str) -> st.SearchStrategy[bytes]:
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    drawn = from_schema(schema, document["components"]["schemas"])
    keys = list(document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]["properties"])
    base = bases(name)[path]

    def overlay(body: dict, fields: list[str]) -> dict:
        return {**base, **{key: body[key] for key in fields if key in body}}

    def mutate(body: dict, key: str, value: object) -> dict:
        return {**body, key: value}

    overlaid = st.builds(overlay, drawn, st.lists(st.sampled_from(keys), max_size=2, unique=True))
    mutated = st.builds(mutate, overlaid, st.sampled_from(keys), any_json)
    bodies = st.one_of(overlaid, mutated, drawn).map(lambda body: _short(path, body))
    literal = st.builds(_with_literal, bodies, st.sampled_from(keys), bad_literal)
    as_bytes = bodies.map(lambda body: json.dumps(body).encode("utf-8", "surrogatepass"))
    return st.one_of(as_bytes, literal)


def _short(path: str, body: dict) -> dict:
    """Bound the output length of a generated request (only where it is a plain positive int)."""
    if path == "/generate":
        params = body.get("sampling_params")
        for p in params if isinstance(params, list) else [params]:
            if isinstance(p, dict) and isinstance(p.get("max_new_tokens"), int) and p["max_new_tokens"] > 0:
                p["max_new_tokens"] = min(p["max_new_tokens"], MAX_GENERATED_TOKENS)
            elif isinstance(p, dict):
                p.setdefault("max_new_tokens", MAX_GENERATED_TOKENS)
    for key in ("max_tokens", "max_completion_tokens"):
        if path.startswith("/v1") and not (isinstance(body.get(key), int) and body[key] <= 0):
            body[key] = min(body[key], MAX_GENERATED_TOKENS) if isinstance(body.get(key), int) else MAX_GENERATED_TOKENS
    return body


def _with_literal(body: dict, key: str, literal: str) -> bytes:
    text = json.dumps({**body, key: "__LITERAL__"}).replace('"__LITERAL__"', literal)
    return text.encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("path", ROUTES)
def test_generated_requests_never_get_a_5xx(server, document, client, name, path):
    slowest_health, statuses = [0.0], collections.Counter()

    @FUZZ_SETTINGS
    @given(body=body_strategy(document, path, name))
    def check(body: bytes) -> None:
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (path, body[:300], response.text[:300])
        statuses[response.status_code] += 1
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", error
        start = time.monotonic()
        assert client.get("/health").status_code == 200
        slowest_health[0] = max(slowest_health[0], time.monotonic() - start)

    check()
    print(f"{path}: answers {dict(sorted(statuses.items()))}; slowest /health {slowest_health[0] * 1000:.1f} ms")
    _assert_idle_and_no_leak(client)


def _assert_idle_and_no_leak(client: httpx.Client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/server_info").json()
        pools = info["pools"].values()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if idle and all(p["in_use"] == 0 and p["free"] + p["cached"] == p["total"] for p in pools):
            return
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {info}"
        time.sleep(0.2)
