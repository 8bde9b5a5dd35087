"""The requests of `bench_serving.py`: random token-id prompts (and random images for chat), one streamed request
timed chunk by chunk, and the Poisson arrival times of a run (serving_clients.py sends them)."""

from __future__ import annotations

import base64
import io
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import openai
from serving_metrics import RequestRecord, arrival_timings, emit_timings

FIRST_SAFE_TOKEN_ID = 3  # Gemma: 0 <pad>, 1 <eos>, 2 <bos>


@dataclass
class RequestSpec:
    """One request to send: a prompt (token ids, or text for chat), the output length to ask for, and the
    images (data: URLs) a chat request sends before its text."""

    prompt: list[int] | str
    input_len: int
    output_len: int
    images: tuple[str, ...] = ()


# ---- dataset ----------------------------------------------------------------------------------------------
def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length uniform in [range_ratio * length, length] (at least 1)."""
    return rng.randint(max(1, int(range_ratio * length)), max(1, length))


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, rng: random.Random
) -> list[RequestSpec]:
    """`num` prompts of random token ids in [FIRST_SAFE_TOKEN_ID, vocab_size) with random lengths."""
    specs = []
    for _ in range(num):
        n_in, n_out = sample_len(rng, input_len, range_ratio), sample_len(rng, output_len, range_ratio)
        ids = [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size) for _ in range(n_in)]
        specs.append(RequestSpec(ids, n_in, n_out))
    return specs


def as_chat_text(specs: list[RequestSpec], tokenizer_path: str) -> list[RequestSpec]:
    """The same requests with their ids decoded to text (chat messages carry text, not ids), by the tokenizer the
    server loads for `tokenizer_path` (a dummy preset's stand-in too)."""
    from srt.managers.tokenizer_loader import load_tokenizer  # only the chat backend needs a tokenizer
    from srt.server_args import ServerArgs

    tokenizer = load_tokenizer(ServerArgs(model_path=tokenizer_path))
    return [RequestSpec(tokenizer.decode(s.prompt, skip_special_tokens=True), s.input_len, s.output_len) for s in specs]


def random_image_url(width: int, height: int, rng: random.Random) -> str:
    """A `data:image/jpeg;base64,` URL of uniformly random pixels (as vLLM's random-mm dataset sends them):
    every image differs, so the server's encoder cache finds none of them."""
    import numpy as np  # only image workloads need numpy and PIL
    from PIL import Image

    pixels = np.random.default_rng(rng.getrandbits(64)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def with_images(specs: list[RequestSpec], count: int, size: tuple[int, int], rng: random.Random) -> list[RequestSpec]:
    """The same requests, each with `count` random images of `size` (width, height)."""
    return [replace(s, images=tuple(random_image_url(*size, rng) for _ in range(count))) for s in specs]


def chat_content(spec: RequestSpec) -> str | list[dict]:
    """A chat request's user message content: its text, after its images if it has any."""
    if not spec.images:
        return spec.prompt
    images = [{"type": "image_url", "image_url": {"url": url}} for url in spec.images]
    return [*images, {"type": "text", "text": spec.prompt}]


# ---- one request ------------------------------------------------------------------------------------------
async def open_stream(
    client: openai.AsyncOpenAI,
    backend: str,
    model: str,
    spec: RequestSpec,
    logprobs: bool = False,
    emit_ts: bool = False,
) -> openai.AsyncStream:
    """Start one streamed request that asks for exactly `spec.output_len` tokens (and logprobs and srt's emit
    timestamps if asked)."""
    common = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True, **({"return_emit_ts": True} if emit_ts else {})},
    }
    if backend == "chat":
        if logprobs:
            common["logprobs"] = True
        messages = [{"role": "user", "content": chat_content(spec)}]
        return await client.chat.completions.create(messages=messages, **common)
    if logprobs:
        common["logprobs"] = 0  # the chosen token's logprob only
    # Token ids travel in extra_body, which the SDK sends as it is: passed as `prompt`, the SDK type-checks
    # every id in Python (~0.1 s per 7000 ids) on the event loop that is timing the other requests.
    common["extra_body"] = {**common["extra_body"], "prompt": spec.prompt}
    return await client.completions.create(prompt="", **common)


def carries_output(choice: Any) -> bool:
    """Whether a streamed choice is output: text, or the end (not chat's opening role-only delta)."""
    text = choice.delta.content if hasattr(choice, "delta") else choice.text
    return bool(text) or choice.finish_reason is not None


def chunk_tokens(choice: Any, by_logprobs: bool) -> int:
    """Output tokens a streamed choice carries: its logprob entries when they were asked for, else 1 for any
    output (one chunk, one token)."""
    if not by_logprobs:
        return int(carries_output(choice))
    if choice.logprobs is None:
        return 0
    entries = choice.logprobs.content if hasattr(choice, "delta") else choice.logprobs.tokens
    return len(entries or [])


async def send_request(
    client: openai.AsyncOpenAI,
    backend: str,
    model: str,
    spec: RequestSpec,
    logprobs: bool = False,
    emit_ts: bool = False,
) -> RequestRecord:
    """Send one request, time its chunks; a failure is recorded, not raised. With `emit_ts`, also where each
    chunk waited (serving_metrics.emit_timings)."""
    record = RequestRecord(input_len=spec.input_len, output_len=spec.output_len)
    arrivals: list[tuple[float, int]] = []  # (time, tokens) of each chunk that carried output
    emitted: list[tuple[dict[str, float], int]] = []  # (the chunk's emit_ts and wall-clock arrival, tokens)
    usage = None
    record.sent_at, start = time.time(), time.perf_counter()
    try:
        stream = await open_stream(client, backend, model, spec, logprobs, emit_ts)
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage or usage
            tokens = sum(chunk_tokens(choice, logprobs) for choice in chunk.choices)
            if tokens:
                arrivals.append((now, tokens))
                if emit_ts:
                    emitted.append(({**chunk.model_extra["emit_ts"], "client": time.time()}, tokens))
        record.e2e_s = time.perf_counter() - start
    except Exception as error:  # any failure of one request is a data point, not the end of the run
        record.error = f"{type(error).__name__}: {error}"
        return record
    if not arrivals:
        record.error = "the stream ended without output"
        return record
    record.ttft_s, record.itl_s = arrival_timings(start, arrivals)
    if emitted:
        record.server_itl_s, record.emit_lag_s = emit_timings(emitted)
        record.first_emit_ts = emitted[0][0]
    record.chunks = len(arrivals)
    record.output_tokens = usage.completion_tokens if usage else sum(tokens for _, tokens in arrivals)
    record.input_len = usage.prompt_tokens if usage else spec.input_len
    record.success = True
    return record


# ---- the run ----------------------------------------------------------------------------------------------
def arrival_offsets(num: int, request_rate: float, rng: random.Random) -> list[float]:
    """When each of `num` requests is due, in seconds after the first: Poisson arrivals at `request_rate`
    (exponential gaps), or all at once for inf."""
    offsets, at = [], 0.0
    for i in range(num):
        offsets.append(at)
        if math.isfinite(request_rate) and i + 1 < num:
            at += rng.expovariate(request_rate)
    return offsets
