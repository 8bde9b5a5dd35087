"""launch_server's command line, `--model` resolution, a dummy preset's tokenizer, and the split and checks of a
generate request (no processes)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import pytest

from srt.entrypoints.launch_server import parse_args
from srt.entrypoints.model_source import resolve_model_path
from srt.managers.generate_input import GenerateReqInput
from srt.managers.io_struct import SchedulerInfo
from srt.managers.ipc import PortArgs
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.tools.tokenizer_builder import build_tokenizer


def test_every_server_arg_is_a_flag_with_help():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {action.dest: action for action in parser._actions}
    for field in dataclasses.fields(ServerArgs):
        assert field.name in actions and actions[field.name].help, field.name
    assert "--model" in actions["model_path"].option_strings
    for serving in ("host", "port", "served_model_name", "log_interval", "max_request_body_mb"):
        assert serving in actions
    for action in actions.values():  # each default said once (#29: several flags printed theirs twice)
        assert (action.help or "").lower().count("default") <= 1, action.help


def test_model_alias_and_preset_with_dummy_weights():
    args = parse_args(["--model", "tiny-gemma-4-E4B-it", "--load-format", "dummy", "--port", "8123"])
    assert args.model_path == "tiny-gemma-4-E4B-it" and args.port == 8123
    assert args.served_model_name == "tiny-gemma-4-E4B-it"


def test_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path.parent))


def test_name_in_the_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "models--google--gemma-4-E4B-it"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("google/gemma-4-E4B-it") == str(snapshot)
    assert resolve_model_path("gemma-4-E4B-it") == str(snapshot)  # a preset name that is also cached


def test_preset_without_dummy_says_how(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="--load-format dummy"):
        resolve_model_path("gemma-4-31B-it")


def test_unknown_model_says_what_was_tried(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "no-such-model-anywhere"])
    message = capsys.readouterr().err
    assert "Hugging Face cache" in message and "--load-format dummy" in message and "google/no-such" in message


def test_generate_request_split():
    obj = GenerateReqInput(text=["a", "b"], sampling_params={"n": 2, "seed": 5, "temperature": 1.0})
    singles = obj.expand()
    assert [(s.index, s.text, s.sampling_params["seed"]) for s in singles] == [
        (0, "a", 5),
        (1, "a", 6),
        (2, "b", 5),
        (3, "b", 6),
    ]
    assert "n" not in singles[0].sampling_params and obj.returns_list()
    # the samples' seeds stay in the generator's range: seed + j wraps modulo 2**64
    last = GenerateReqInput(text="a", sampling_params={"n": 2, "seed": 2**64 - 1}).expand()
    assert [s.sampling_params["seed"] for s in last] == [2**64 - 1, 0]
    assert not GenerateReqInput(input_ids=[1, 2]).returns_list()
    per_prompt = GenerateReqInput(input_ids=[[1], [2, 3]], return_logprob=[True, False], logprob_start_len=[0, -1])
    assert [(s.return_logprob, s.logprob_start_len) for s in per_prompt.expand()] == [(True, 0), (False, None)]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "exactly one of text and input_ids"),
        ({"text": "a", "input_ids": [1]}, "exactly one of text and input_ids"),
        ({"text": 3}, "text"),
        ({"input_ids": [1, "2"]}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "sampling_params": 5}, "sampling_params must be an object"),
        ({"text": "a", "sampling_params": [{}]}, "sampling_params must be an object"),
        ({"text": "a", "sampling_params": {"n": 0}}, "n must be"),
        ({"text": "a", "sampling_params": {"n": 44801913727}}, "n must be at most 128"),  # froze the server once
        ({"text": ["a"] * 3, "sampling_params": [{}, {}, {"n": 129}]}, "n must be at most 128"),
        ({"text": "a", "rid": ["x"]}, "rid must be a string"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "a", "top_logprobs_num": -2}, "top_logprobs_num"),
        ({"text": "a", "stream": 1}, "stream"),
        ({"text": "a", "add_special_tokens": None}, "add_special_tokens"),  # a 500 the fuzzer found
        ({"text": "a", "return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
    ],
)
def test_generate_request_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GenerateReqInput(**kwargs).expand()


def test_rid_must_be_unique_in_a_request_and_among_running_requests():
    info = SchedulerInfo(64, 1024, 1000, 1000, [1], "cpu", "float32")
    port_args = PortArgs.create()
    tm = TokenizerManager(ServerArgs(model_path="m"), port_args, info, build_tokenizer(1024))
    try:
        with pytest.raises(ValueError, match="rid must be unique"):
            tm.prepare(GenerateReqInput(input_ids=[[5, 6], [7, 8]], rid=["a", "a"]))
        samples = tm.prepare(GenerateReqInput(input_ids=[5, 6], rid="a", sampling_params={"n": 2}))
        assert [r.rid for r in samples] == ["a-0", "a-1"]
        tm.states["b"] = None  # a running request
        with pytest.raises(ValueError, match="rid must be unique"):
            tm.prepare(GenerateReqInput(input_ids=[5, 6], rid="b"))
        assert [r.rid for r in tm.prepare(GenerateReqInput(input_ids=[[5, 6], [7]], rid=["c", "d"]))] == ["c", "d"]
    finally:
        asyncio.run(tm.close())
        port_args.cleanup()


@pytest.mark.parametrize("preset", ["tiny-gemma-4-E4B-it", "tiny-gemma-4-26B-A4B-it"])
def test_dummy_preset_tokenizer_templates_as_its_checkpoint(tiny_checkpoint, preset):
    """`--load-format dummy` serves a preset with a stand-in tokenizer: its chat template must be the one
    make_checkpoint saves for that preset (E4B opens the model turn without a thought channel, 26B with one)."""
    from transformers import AutoTokenizer

    from srt.managers.tokenizer_loader import load_tokenizer

    served = load_tokenizer(ServerArgs(model_path=preset, load_format="dummy"))
    saved = AutoTokenizer.from_pretrained(tiny_checkpoint(preset))
    messages = [{"role": "user", "content": "hi"}]
    prompts = [t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for t in (served, saved)]
    assert prompts[0] == prompts[1]


def test_ready_banner_says_when_weights_are_random():
    from srt.entrypoints.ready_banner import examples

    assert "gibberish" in examples("http://h:1", "m", random_weights=True)
    assert "gibberish" not in examples("http://h:1", "m")


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a preset that would take a while to load: the check must come first
        args = ["--model", "gemma-4-E4B-it", "--load-format", "dummy", "--device", "cpu", "--port", str(port)]
        done = subprocess.run([sys.executable, "-m", "srt.launch_server", *args], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "process ready" not in done.stderr
