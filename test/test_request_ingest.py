"""A request of token ids is checked in C-speed passes (an 8k-id prompt took ~8 ms of pure Python per request,
which 8 simultaneous requests paid one after the other in the HTTP process), and the checks still refuse what
they refused: bools and floats among ids, NaN inside a list, ids out of the vocabulary."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from srt.entrypoints.openai.response_parts import RequestError
from srt.entrypoints.request_body import parse_json_object
from srt.managers.generate_input import GenerateReqInput
from srt.managers.io_struct import SchedulerInfo
from srt.managers.ipc import PortArgs
from srt.managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.tools.tokenizer_builder import build_tokenizer


def expand(input_ids: object) -> list:
    return GenerateReqInput(input_ids=input_ids, sampling_params={"max_new_tokens": 1}).expand()


def test_int_ids_pass_and_numpy_ints_take_the_slow_path() -> None:
    assert expand(list(range(8192)))[0].input_ids == list(range(8192))
    assert expand([np.int64(5), 7])[0].input_ids == [5, 7]  # not `int`: checked one by one, still ints


@pytest.mark.parametrize("bad", [[1, True, 3], [1, 2.0, 3], [1, "2"], [[1], 2]])
def test_ids_that_are_not_ints_are_refused(bad: list) -> None:
    with pytest.raises(ValueError, match="input_ids"):
        expand(bad)


def test_a_body_of_int_ids_parses_and_non_finite_numbers_in_a_list_are_still_refused() -> None:
    assert parse_json_object(json.dumps({"prompt": list(range(8192))}).encode())["prompt"][-1] == 8191
    with pytest.raises(RequestError, match="finite"):
        parse_json_object(b'{"prompt": [1, 2, NaN]}')
    with pytest.raises(RequestError, match="Unicode"):
        parse_json_object(b'{"prompt": [1, "\\ud800"]}')


def test_ids_outside_the_vocabulary_are_refused_by_the_tokenizer_manager() -> None:
    vocab = 1024
    port_args = PortArgs.create()
    tm = TokenizerManager(ServerArgs(model_path="m"), port_args, SchedulerInfo(64, vocab, 1000, 1000, [1], "cpu",
                          "float32"), build_tokenizer(vocab))  # fmt: skip
    try:
        for ids in ([0, vocab], [-1, 0]):
            with pytest.raises(ValueError, match="input_ids must be token ids"):
                tm.prepare(GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 1}))
        assert tm.prepare(GenerateReqInput(input_ids=[0, vocab - 1], sampling_params={"max_new_tokens": 1}))
    finally:
        asyncio.run(tm.close())
        port_args.cleanup()
