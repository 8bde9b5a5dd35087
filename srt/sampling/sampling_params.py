"""Per-request sampling parameters, with SGLang's field names and defaults."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

# Below this a temperature is treated as 0: dividing logits by it would overflow float32 (SGLang uses 1e-6 too).
GREEDY_TEMPERATURE_EPS = 1e-6
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's documented range of frequency_penalty and presence_penalty
# SGLang documents [0, 2]; below 0.01 a softcapped logit (|x| <= 30) divided by the penalty leaves float32's range
# in the sampler's later passes (1e-300 made every probability NaN and sampled token 0).
REPETITION_PENALTY_RANGE = (0.01, 2.0)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


@dataclass
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    `top_k == -1` means "no top-k filtering" (SGLang's API); use `effective_top_k` for the number of candidates.
    `stop` accepts a string or a list of strings and is normalised to a list on construction, so code after
    construction only ever sees `list[str]`. Call `validate()` before scheduling: construction does not check
    ranges, so that a bad request produces one `ValueError` naming the field instead of a crash deep in the
    scheduler.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    n: int = 1
    # OpenAI's: token id (an int, or its decimal string as JSON keys are) -> a number added to that token's logit
    logit_bias: dict[int | str, float] | None = None
    # structured output (SGLang's names), at most one: the output must match it (sampling/grammar.py)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        # Anything else is left as is for validate() to report by name.

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a request's JSON object; unknown keys are an error, not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, e.g. ("json_schema", '{"type": "object"}'); None if free."""
        for kind in ("json_schema", "regex", "ebnf"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def uses_token_history(self) -> bool:
        """Whether sampling depends on the tokens generated so far (penalties, min_new_tokens)."""
        penalties = (self.repetition_penalty, self.frequency_penalty, self.presence_penalty) != (1.0, 0.0, 0.0)
        return penalties or self.min_new_tokens > 0

    @property
    def token_biases(self) -> dict[int, float]:
        """`logit_bias` with int keys (after `validate()`); empty without one."""
        return {int(token): float(bias) for token, bias in (self.logit_bias or {}).items()}

    @property
    def is_greedy(self) -> bool:
        """Whether the request always takes the most likely token (temperature 0 or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def effective_top_k(self, vocab_size: int) -> int:
        """Number of candidates top-k keeps: `vocab_size` for -1 ("all") and for any k above the vocabulary."""
        return vocab_size if self.top_k == -1 else min(self.top_k, vocab_size)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `ValueError` naming the first bad field; `vocab_size` enables the stop_token_ids range check."""
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            _check_int(name, getattr(self, name))
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            _check_real(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty}")
        lo, hi = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        grammars = [kind for kind in ("json_schema", "regex", "ebnf") if getattr(self, kind) is not None]
        if len(grammars) > 1:
            raise ValueError(f"{grammars[0]} and {grammars[1]} cannot be combined: give at most one grammar")
        for kind in grammars:
            if not isinstance(getattr(self, kind), str):
                raise ValueError(f"{kind} must be a string, got {type(getattr(self, kind)).__name__}")

        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple):
                raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            for tok in self.stop_token_ids:
                _check_int("stop_token_ids", tok)
                if tok < 0:
                    raise ValueError(f"stop_token_ids must be >= 0, got {tok}")
                if vocab_size is not None and tok >= vocab_size:
                    raise ValueError(f"stop_token_ids must be < vocab_size={vocab_size}, got {tok}")


def _check_logit_bias(logit_bias: object, vocab_size: int | None) -> None:
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a map of token ids to numbers, got {logit_bias!r}")
    seen = set()
    lo, hi = LOGIT_BIAS_RANGE
    for key, bias in logit_bias.items():
        token = _token_id(key)
        if token is None or (vocab_size is not None and token >= vocab_size):
            vocab = f" < vocab_size={vocab_size}" if vocab_size is not None else ""
            raise ValueError(f"logit_bias must have token ids >= 0{vocab} as keys, got {key!r}")
        if token in seen:
            raise ValueError(f"logit_bias has token {token} twice")
        seen.add(token)
        _check_real("logit_bias", bias)
        if not lo <= bias <= hi:
            raise ValueError(f"logit_bias must have values in [{lo:g}, {hi:g}], got {bias} for token {token}")


def _token_id(key: object) -> int | None:
    """A logit_bias key as a token id: an int, or a string of decimal digits; None otherwise."""
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key) if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:  # past any vocabulary
        return int(key)
    return None


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass, but `top_k=True` is a client bug, not a request for k=1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):  # NaN passes every range comparison as False; inf passes "> 0" checks
        raise ValueError(f"{name} must be a finite number, got {value!r}")
