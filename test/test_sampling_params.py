"""SamplingParams: SGLang defaults, normalisation, validation errors that name the field, unknown keys."""

from __future__ import annotations

import math
import re

import pytest

from srt.sampling import SamplingParams


def test_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 0, 1.0, 1.0, -1, 0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.ignore_eos is False and p.skip_special_tokens is True and p.n == 1
    assert p.stop == [] and p.stop_token_ids is None
    p.validate(vocab_size=10)


def test_stop_string_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_greedy_and_effective_top_k() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    assert SamplingParams(top_k=-1).effective_top_k(100) == 100
    assert SamplingParams(top_k=500).effective_top_k(100) == 100
    assert SamplingParams(top_k=7).effective_top_k(100) == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(frequency_penalty=-2.0, presence_penalty=2.0),
        dict(max_new_tokens=0),
        dict(max_new_tokens=5, min_new_tokens=5),
        dict(repetition_penalty=0.5),
        dict(stop_token_ids=[0, 9]),
        dict(seed=0),
        dict(seed=-(2**63)),
        dict(seed=2**64 - 1),
        dict(repetition_penalty=0.01),
        dict(repetition_penalty=2.0),
        dict(temperature=2),  # an int is a fine number
    ],
)
def test_valid_edges_pass(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-1), "temperature must be >= 0, got -1"),
        (dict(temperature="0.5"), "temperature must be a number"),
        (dict(temperature=math.nan), "temperature must be a finite number"),
        (dict(temperature=math.inf), "temperature must be a finite number"),
        (dict(top_p=-math.inf), "top_p must be a finite number"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k must be an int"),
        (dict(top_k=True), "top_k must be an int"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty must be in [0.01, 2.0]"),
        (dict(repetition_penalty=2.5), "repetition_penalty must be in [0.01, 2.0]"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(stop_token_ids=[3, 10]), "stop_token_ids must be < vocab_size=10, got 10"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["x"]), "stop_token_ids"),
        (dict(stop=[1]), "stop"),
        (dict(n=0), "n must be >= 1"),
        (dict(seed="7"), "seed"),
        (dict(seed=2**64), "seed must be in [-2**63, 2**64 - 1]"),
        (dict(seed=-(2**63) - 1), "seed must be in [-2**63, 2**64 - 1]"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(logit_bias=[1, 2]), "logit_bias must be a map of token ids to numbers"),
        (dict(logit_bias={"abc": 1}), "logit_bias must have token ids >= 0 < vocab_size=10 as keys, got 'abc'"),
        (dict(logit_bias={"-1": 1}), "logit_bias must have token ids"),
        (dict(logit_bias={10: 1}), "logit_bias must have token ids"),
        (dict(logit_bias={"9" * 30: 1}), "logit_bias must have token ids"),
        (dict(logit_bias={True: 1}), "logit_bias must have token ids"),
        (dict(logit_bias={3: 1, "3": 2}), "logit_bias has token 3 twice"),
        (dict(logit_bias={3: math.nan}), "logit_bias must be a finite number"),
        (dict(logit_bias={3: "1"}), "logit_bias must be a number"),
        (dict(logit_bias={3: 100.5}), "logit_bias must have values in [-100, 100], got 100.5 for token 3"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs).validate(vocab_size=10)


def test_stop_token_range_checked_only_with_vocab() -> None:
    SamplingParams(stop_token_ids=[10**6]).validate()


def test_logit_bias_takes_int_and_decimal_string_keys() -> None:
    params = SamplingParams(logit_bias={"7": 5, 2: -100.0, "0": 0.5})
    params.validate(vocab_size=10)
    assert params.token_biases == {7: 5.0, 2: -100.0, 0: 0.5}
    assert SamplingParams().token_biases == {}


def test_from_dict_builds_and_rejects_unknown_keys() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "max_new_tokens": 3})
    assert (p.temperature, p.stop, p.max_new_tokens) == (0.5, ["x"], 3)
    with pytest.raises(ValueError, match="best_of, temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "best_of": 2})
