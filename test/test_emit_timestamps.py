"""`return_emit_ts`: streamed chunks say when their tokens left each serving process, and nothing else changes.

Against a real server (tiny E4B, float32, cpu) through the real `openai` client: with the flag every output
chunk carries `emit_ts` with its stages in the order a token passes them; without it no chunk has one; the
streamed text and tokens are the same either way and equal the scheduler run in this process.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serving_fixtures import PRESET, greedy_reference, openai_client, reference_scheduler, wait_idle
from torch_threads import one_torch_thread
from transformers import AutoTokenizer

NEW_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS}
STAGES = ["scheduler", "detokenizer", "tokenizer_manager", "sse"]  # the order a token passes them
PROMPT = "The emit timestamps of a stream say"


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's server (conftest.py); this module leaves it idle with no slot leaked."""
    yield shared_server
    wait_idle(shared_server.url)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def reference_ids(model, tokenizer):
    """Greedy output ids of PROMPT run alone in this process (one torch thread, as the server's)."""
    with one_torch_thread():
        return greedy_reference(reference_scheduler(model), [tokenizer.encode(PROMPT)], NEW_TOKENS)[0]


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.models.list().data[0].id


def check_emit_ts(stamps: list[dict]) -> None:
    """Each chunk's stages in order; consecutive chunks' scheduler times never go back."""
    assert stamps, "no chunk carried emit_ts"
    for times in stamps:
        assert list(times) == STAGES
        assert all(a <= b for a, b in zip(times.values(), list(times.values())[1:])), times
    scheduler = [times["scheduler"] for times in stamps]
    assert scheduler == sorted(scheduler)


def test_completion_stream_with_emit_ts_is_unchanged(client, name, tokenizer, reference_ids):
    request = {"model": name, "prompt": PROMPT, "stream": True, **GREEDY}
    plain = list(client.completions.create(**request, extra_body={"ignore_eos": True}))
    timed = list(client.completions.create(**request, extra_body={"ignore_eos": True, "return_emit_ts": True}))

    want = tokenizer.decode(reference_ids, skip_special_tokens=True)
    assert "".join(c.choices[0].text for c in plain) == want
    assert [c.choices[0].model_dump() for c in timed] == [c.choices[0].model_dump() for c in plain]
    assert all("emit_ts" not in (c.model_extra or {}) for c in plain)
    check_emit_ts([c.model_extra["emit_ts"] for c in timed])
    assert len(timed) >= 2  # more than one chunk: the order across chunks was checked


def test_chat_stream_stamps_output_chunks_only(client, name):
    request = {
        "model": name, "messages": [{"role": "user", "content": "Count."}], "stream": True,
        "stream_options": {"include_usage": True}, **GREEDY,
    }  # fmt: skip
    plain = list(client.chat.completions.create(**request, extra_body={"ignore_eos": True}))
    timed = list(client.chat.completions.create(**request, extra_body={"ignore_eos": True, "return_emit_ts": True}))

    assert [c.choices[0].model_dump() for c in timed if c.choices] == [
        c.choices[0].model_dump() for c in plain if c.choices
    ]
    usage = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in (timed[-1], plain[-1])]
    assert usage[0] == usage[1]  # (cached tokens differ: the second request hits the first one's prefix)
    # the opening role-only chunk and the usage chunk carry no tokens, so no emit times
    assert "emit_ts" not in timed[0].model_extra and "emit_ts" not in timed[-1].model_extra
    check_emit_ts([c.model_extra["emit_ts"] for c in timed[1:-1]])


def test_native_generate_stream_has_emit_ts_in_meta_info(server, tokenizer, reference_ids):
    body = {
        "text": PROMPT, "stream": True, "return_emit_ts": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }  # fmt: skip
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    assert sum((c["output_ids"] for c in chunks), []) == reference_ids
    stamps = [c["meta_info"]["emit_ts"] for c in chunks]
    assert all(list(times) == STAGES[:-1] for times in stamps)  # no SSE stage on the native route
    check_emit_ts([{**times, "sse": times["tokenizer_manager"]} for times in stamps])

    bad = httpx.post(f"{server.url}/generate", json={**body, "return_emit_ts": "yes"}, timeout=60)
    assert bad.status_code == 400 and "return_emit_ts must be a bool" in bad.json()["error"]["message"]
