"""Messages between the request front-end and the scheduler (pickled dataclasses over ZMQ, or direct calls)."""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    """A generation request whose prompt is already token ids."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int | None = None  # prompt logprobs from this position on (None: none)
    top_logprobs_num: int = 0
    stream: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped: "stop" (EOS, stop token or stop string), "length" or "abort"."""

    kind: str
    matched: int | str | None = None  # the token id or string that stopped it
    message: str | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.kind}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass
class TokenLogprob:
    """Log-probability of one token, optionally with the top alternatives at that position."""

    token_id: int
    logprob: float | None  # None for the first prompt token (nothing predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ReqOutput:
    """What one scheduler step produced for one request (new tokens since the last output)."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None
