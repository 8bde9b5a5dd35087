"""The HTTP server against the real `openai` client: the session's shared server (conftest.py: tiny E4B, float32,
cpu; its end checks that SIGTERM leaves no child process).

Greedy outputs are checked against the scheduler run in this process on the same checkpoint, so the
whole path (tokenize -> ZMQ -> scheduler -> detokenize -> HTTP) must not change a single token.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
from serving_fixtures import (
    PRESET,
    greedy_reference,
    openai_client,
    prompt_logprobs_reference,
    reference_scheduler,
    wait_idle,
)
from torch_threads import one_torch_thread
from transformers import AutoTokenizer

import srt

NEW_TOKENS = 8
PROMPTS = [f"Request {i}: the weather in city number {i * 7} is" for i in range(32)]
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS}
NO_EOS = {"ignore_eos": True}  # an SGLang extension: random weights may pick EOS early, which tests less


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's server (conftest.py), whose end checks that SIGTERM leaves no child process; this module
    leaves it idle with no slot leaked."""
    yield shared_server
    wait_idle(shared_server.url)


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def reference(model):
    """In-process scheduler; one torch thread, as the server's, so float sums add up in the same order."""
    with one_torch_thread():
        yield reference_scheduler(model)


@pytest.fixture(scope="module")
def client(server, model):
    return openai_client(server)


@pytest.fixture(scope="module")
def name(model) -> str:
    return str(model)


def expected_text(tokenizer, reference, prompt_ids: list[int], max_tokens: int = NEW_TOKENS) -> str:
    return tokenizer.decode(greedy_reference(reference, [prompt_ids], max_tokens)[0], skip_special_tokens=True)


def test_models_and_health(server, client, name):
    assert [m.id for m in client.models.list().data] == [name]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": srt.__version__}
    info = httpx.get(f"{server.url}/get_model_info").json()
    assert info["model_path"] == name and info["is_generation"] is True


def test_completion_matches_reference_streamed_or_not(client, name, tokenizer, reference):
    prompt = PROMPTS[0]
    out = client.completions.create(model=name, prompt=prompt, **GREEDY, extra_body=NO_EOS)
    assert out.choices[0].text == expected_text(tokenizer, reference, tokenizer.encode(prompt))
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == NEW_TOKENS and out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    chunks = list(client.completions.create(model=name, prompt=prompt, stream=True, **GREEDY, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    ids_out = client.completions.create(model=name, prompt=tokenizer.encode(prompt), **GREEDY, extra_body=NO_EOS)
    assert ids_out.choices[0].text == out.choices[0].text


def test_completion_logprobs_and_echo(client, name, tokenizer, reference):
    prompt = PROMPTS[1]
    out = client.completions.create(model=name, prompt=prompt, logprobs=3, **GREEDY, extra_body=NO_EOS)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == NEW_TOKENS
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4 and math.isclose(max(top.values()), chosen)  # greedy: the top

    # lm-eval's loglikelihood: score the prompt itself, generate nothing; the <bos> the server adds is not echoed
    ids = tokenizer.encode(prompt)
    echo = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = echo.choices[0]
    assert choice.text == prompt and echo.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(ids) - 1
    want = prompt_logprobs_reference(reference, ids, 1)
    got = choice.logprobs.token_logprobs
    assert got == pytest.approx([entry.logprob for entry in want[1:]], abs=1e-4)


def test_n_samples_with_seed(client, name):
    kwargs = {"model": name, "prompt": PROMPTS[2], "max_tokens": NEW_TOKENS, "n": 3, "seed": 7, "temperature": 1.0}
    first = client.completions.create(**kwargs, extra_body=NO_EOS)
    again = client.completions.create(**kwargs, extra_body=NO_EOS)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # ...and the samples differ from each other
    assert first.usage.completion_tokens == 3 * NEW_TOKENS
    batch = client.completions.create(model=name, prompt=PROMPTS[:2], n=2, **GREEDY, extra_body=NO_EOS)
    texts = [c.text for c in batch.choices]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]  # prompt-major order


def test_stop_string_cuts_text_and_stops_the_scheduler(server, client, name, tokenizer, reference):
    prompt = PROMPTS[3]
    full = expected_text(tokenizer, reference, tokenizer.encode(prompt), 40)
    stop = full[12:15]
    assert stop.strip(), f"pick another prompt: {full!r}"
    before = httpx.get(f"{server.url}/server_info").json()["generated_tokens_total"]
    params = {"model": name, "prompt": prompt, "temperature": 0.0, "max_tokens": 400, "stop": [stop]}
    out = client.completions.create(**params, extra_body=NO_EOS)
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**params, stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    # the scheduler stopped soon after the stop string, not after max_tokens (two requests ran)
    after = httpx.get(f"{server.url}/server_info").json()["generated_tokens_total"]
    assert after - before < 2 * (out.usage.completion_tokens + 10)


def test_chat_matches_reference_with_logprobs(client, name, tokenizer, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    want = expected_text(tokenizer, reference, ids)
    out = client.chat.completions.create(
        model=name, messages=messages, logprobs=True, top_logprobs=2, **GREEDY, extra_body=NO_EOS
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want
    assert len(choice.logprobs.content) == NEW_TOKENS == out.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2 and math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
    assert out.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(
        model=name, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY,
        extra_body=NO_EOS,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW_TOKENS


def test_concurrent_streams_match_one_at_a_time(server, name, tokenizer, reference):
    want = [
        tokenizer.decode(ids, skip_special_tokens=True)
        for ids in greedy_reference(reference, [tokenizer.encode(p) for p in PROMPTS], NEW_TOKENS)
    ]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=name, prompt=prompt, stream=True, **GREEDY, extra_body=NO_EOS)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    assert asyncio.run(run_all()) == want


def test_native_generate(server, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS[4])
    want = greedy_reference(reference, [ids], NEW_TOKENS)[0]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    one = httpx.post(f"{server.url}/generate", json={"text": PROMPTS[4], "sampling_params": params}).json()
    assert one["output_ids"] == want and one["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert one["meta_info"]["prompt_tokens"] == len(ids) and one["meta_info"]["finish_reason"]["type"] == "length"
    body = {"input_ids": [ids, ids[:5]], "sampling_params": params, "return_logprob": True, "logprob_start_len": 0}
    batch = httpx.post(f"{server.url}/generate", json=body).json()
    assert batch[0]["output_ids"] == want and len(batch) == 2
    assert len(batch[1]["meta_info"]["input_token_logprobs"]) == 5
    assert len(batch[1]["meta_info"]["output_token_logprobs"]) == NEW_TOKENS
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert sum((c["output_ids"] for c in chunks if c["index"] == 0), []) == want


def test_disconnect_mid_stream_frees_the_request(server, name):
    before = httpx.get(f"{server.url}/server_info").json()["generated_tokens_total"]
    body = {"model": name, "prompt": PROMPTS[5], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, **NO_EOS}) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leave mid-stream: closing the connection must abort the request
    info = wait_idle(server.url)
    assert 0 < info["generated_tokens_total"] - before < 400  # stopped early, not run to max_tokens
    for pool in info["pools"].values():
        assert pool["in_use"] == 0 and pool["free"] + pool["cached"] == pool["total"]


def test_disconnect_while_waiting_for_a_whole_response(server, name):
    before = httpx.get(f"{server.url}/server_info").json()["generated_tokens_total"]
    # 16 long requests: seconds of work on this model, which the server notices is abandoned within a second
    body = {"model": name, "prompt": PROMPTS[:16], "max_tokens": 480, "temperature": 0, **NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    info = wait_idle(server.url)
    assert 0 < info["generated_tokens_total"] - before < 16 * 480 // 2
    assert all(pool["in_use"] == 0 for pool in info["pools"].values())


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "M", "prompt": ', None),  # malformed JSON
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0.0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "word " * 600}, "prompt"),
    ("/v1/completions", {"prompt": [5, 6, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": -1}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [1, -3]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": 5}, "sampling_params"),
    ("/generate", {"text": "hi", "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": "hi", "suffix": "and then"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}},
        "logit_bias",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"-4": 1}}}, "logit_bias"),
]


def test_logit_bias_forces_and_bans_tokens(server, client, name, tokenizer):
    """OpenAI's logit_bias through the real client and /generate: +100 makes a token every greedy choice, -100
    takes the unbiased first choice out."""
    token = tokenizer.encode(" weather", add_special_tokens=False)[-1]
    out = client.completions.create(model=name, prompt="hi", logit_bias={str(token): 100}, **GREEDY, extra_body=NO_EOS)
    assert out.choices[0].text == tokenizer.decode([token] * NEW_TOKENS)

    def first_ids(**sampling) -> list[int]:
        body = {
            "text": "hi",
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, **sampling},
        }
        return httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["output_ids"]

    plain = first_ids()
    assert first_ids(logit_bias={str(plain[0]): -100})[0] != plain[0]
    assert first_ids(logit_bias={str(token): 100}) == [token] * 3


def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, name):
    for path, body, param in BAD_REQUESTS:
        if isinstance(body, dict) and path.startswith("/v1"):
            body = {"model": name, **body}
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = httpx.post(f"{server.url}{path}", **kwargs, timeout=30)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        assert error["param"] == param, (body, error)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="hi", temperature=-1)
    assert client.completions.create(model=name, prompt="hi", max_tokens=2).usage.completion_tokens <= 2


def test_metrics_and_server_info(server):
    # histograms print their buckets once they hold an observation: serve one request of our own first
    httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    text = httpx.get(f"{server.url}/metrics").text
    for metric in (
        "srt_num_running_reqs",
        "srt_num_waiting_reqs",
        'srt_kv_usage_ratio{model_name="',
        'pool="swa"',
        "srt_cache_hit_rate",
        "srt_time_to_first_token_seconds_bucket",
        "srt_inter_token_latency_seconds_bucket",
        "srt_prompt_tokens_total",
        "srt_generation_tokens_total",
    ):
        assert metric in text, metric
    info = wait_idle(server.url)
    assert info["server_args"]["context_length"] == 512 and set(info["pools"]) == {"full", "swa"}
    assert set(info["pools"]["full"]) >= {"total", "free", "cached", "in_use"}
