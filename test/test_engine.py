"""`srt.Engine`: the same results as the in-process scheduler, in every calling style; no child outlives it."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
from serving_fixtures import (
    CHILD_ENV,
    MODEL_ARGS,
    PRESET,
    alive,
    child_pids,
    greedy_reference,
    is_resource_tracker,
    reference_scheduler,
)
from torch_threads import one_torch_thread
from transformers import AutoTokenizer

from srt import Engine

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def child_env():
    saved = {key: os.environ.get(key) for key in CHILD_ENV}
    os.environ.update(CHILD_ENV)  # spawned children inherit it
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# the processes each module-scoped engine started (the last test shuts it down and checks they are gone)
ENGINE_CHILDREN: set[int] = set()


@pytest.fixture(scope="module")
def engine(model, child_env):
    before = child_pids(os.getpid())
    with Engine(model_path=str(model), log_level="warning", **MODEL_ARGS) as engine:
        started = child_pids(os.getpid()) - before
        ENGINE_CHILDREN.update(pid for pid in started if not is_resource_tracker(pid))
        yield engine


@pytest.fixture(scope="module")
def expected(model):
    tokenizer = AutoTokenizer.from_pretrained(model)
    with one_torch_thread():  # as the engine's scheduler: the same float summation order
        ids = greedy_reference(reference_scheduler(model), [tokenizer.encode(p) for p in PROMPTS], NEW_TOKENS)
    return [(out, tokenizer.decode(out, skip_special_tokens=True)) for out in ids]


def test_generate_single_and_batch(engine, expected):
    one = engine.generate(PROMPTS[0], GREEDY)
    assert (one["output_ids"], one["text"]) == expected[0]
    meta = one["meta_info"]
    assert meta["completion_tokens"] == NEW_TOKENS and meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0
    batch = engine.generate(PROMPTS, GREEDY)
    assert [(r["output_ids"], r["text"]) for r in batch] == expected


def test_stream_and_async(engine, expected):
    chunks = list(engine.generate(PROMPTS[1], GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == expected[1][1]
    assert sum((c["output_ids"] for c in chunks), []) == expected[1][0]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    async def run() -> tuple[dict, str]:
        whole = await engine.async_generate(PROMPTS[2], GREEDY)
        stream = await engine.async_generate(PROMPTS[2], GREEDY, stream=True)
        return whole, "".join([chunk["text"] async for chunk in stream])

    whole, streamed = asyncio.run(run())
    assert whole["text"] == streamed == expected[2][1]


def test_logprobs_and_input_ids(engine, expected):
    tokenizer_ids = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 0})
    assert tokenizer_ids["output_ids"] == [] and tokenizer_ids["meta_info"]["completion_tokens"] == 0
    out = engine.generate(PROMPTS[0], GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    assert [entry[1] for entry in meta["output_token_logprobs"]] == expected[0][0]
    assert all(len(top) == 2 and top[0][0] == entry[0] for top, entry in zip(
        meta["output_top_logprobs"], meta["output_token_logprobs"]
    ))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"warmth": 1}}, "warmth"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"input_ids": [-1, 1]}, "input_ids"),
        ({"prompt": "hi", "input_ids": [1]}, "input_ids"),
        ({"prompt": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"prompt": "hi", "sampling_params": {"seed": 2**64}}, "seed must be in"),
        ({"prompt": "hi", "sampling_params": {"seed": 2**64}, "stream": True}, "seed must be in"),
        ({"prompt": "hi", "sampling_params": {"n": 10**12}}, "n must be at most"),
        ({"prompt": "a\ud800b"}, "text must be valid Unicode: the prompt"),
        ({"prompt": ""}, "text must not be empty"),
        ({"prompt": "hi", "sampling_params": {"temperature": float("inf")}}, "temperature must be a finite"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)  # raises before anything runs, also with stream=True


def test_server_info_is_idle_after_requests(engine):
    info = engine.get_server_info()
    assert info["model"]["context_len"] == MODEL_ARGS["context_length"]
    assert info["num_running_reqs"] == 0
    for pool in info["pools"].values():
        assert pool["in_use"] == 0 and pool["free"] + pool["cached"] == pool["total"]


def test_shutdown_leaves_no_child(engine):
    assert len(ENGINE_CHILDREN) >= 2  # scheduler and detokenizer
    engine.shutdown()
    engine.shutdown()  # twice is fine
    assert all(not alive(pid) for pid in ENGINE_CHILDREN)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hi")


def test_startup_failure_names_the_child_and_its_error(model, tmp_path, child_env):
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    before = child_pids(os.getpid())
    with pytest.raises(RuntimeError, match="scheduler process failed to start") as failure:
        Engine(model_path=str(broken), log_level="error", **MODEL_ARGS)
    assert "Traceback" in str(failure.value)
    left = {pid for pid in child_pids(os.getpid()) - before if not is_resource_tracker(pid)}
    assert not left  # the detokenizer was stopped too
