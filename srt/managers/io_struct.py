"""Messages between the request front-end and the scheduler (pickled dataclasses over ZMQ, or direct calls)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, fields

from srt.multimodal.inputs import MultimodalInputs
from srt.sampling.sampling_params import SamplingParams


def check_vocab_ids(ids: list[int], vocab_size: int) -> None:
    """ValueError unless every id is in [0, vocab_size): min and max run in C (8k ids in ~0.1 ms)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size})")


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
    grammar: str | None = None  # the compiled grammar of sampling_params.grammar, serialized (sampling/grammar.py)
    mm_inputs: MultimodalInputs | None = None  # the prompt's images (patches pickled once, as numpy arrays)

    def check(self, vocab_size: int, context_len: int, pool_tokens: int) -> None:
        """ValueError naming the field that makes this request unservable by a model and its KV pool."""
        self.sampling_params.validate(vocab_size)
        if not self.input_ids:
            raise ValueError("input_ids must not be empty")
        check_vocab_ids(self.input_ids, vocab_size)
        if len(self.input_ids) >= context_len:
            raise ValueError(f"input_ids has {len(self.input_ids)} tokens; the context length is {context_len}")
        if len(self.input_ids) >= pool_tokens:
            raise ValueError(f"input_ids has {len(self.input_ids)} tokens; the KV pool holds {pool_tokens}")
        start = self.logprob_start_len
        if start is not None and not 0 <= start <= len(self.input_ids):
            raise ValueError(f"logprob_start_len must be in [0, {len(self.input_ids)}], got {start}")


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
    spec_verify_ct: int = 0  # speculative decoding: verify rounds so far
    spec_accepted_tokens: int = 0  # drafts accepted so far

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


# ---- between the serving processes (see srt/managers/scheduler_process.py) ---------------------------------


@dataclass
class DetokenizeInit:
    """Scheduler -> detokenizer, before any output of the request: how to turn its tokens into text."""

    rid: str
    stop: list[str]
    skip_special_tokens: bool
    replica: int = 0  # the data-parallel replica running it: where a stop string's abort goes


@dataclass(frozen=True)
class EmitTimes:
    """When one step's outputs left each serving process: wall-clock seconds (`time.time()`, comparable
    across the processes of one host), in SGLang's `*_ts` style. A request with `return_emit_ts` gets them
    in every streamed chunk; stamping one float per process per step costs nothing measurable otherwise."""

    scheduler: float  # the scheduler sent the step's tokens
    detokenizer: float = 0.0  # the detokenizer sent their text
    tokenizer_manager: float = 0.0  # the tokenizer manager received it

    def stamp(self, stage: str) -> EmitTimes:
        """These times with `stage` set to now."""
        return dataclasses.replace(self, **{stage: time.time()})

    def to_json(self) -> dict[str, float]:
        # spelled out: dataclasses.asdict deep-copies, a cost paid on every chunk of a timed stream
        times = {"scheduler": self.scheduler, "detokenizer": self.detokenizer}
        return {**times, "tokenizer_manager": self.tokenizer_manager}


@dataclass
class BatchTokenIDOut:
    """Scheduler -> detokenizer: the outputs of one scheduler step (built right before it is sent)."""

    outputs: list[ReqOutput]
    times: EmitTimes = field(default_factory=lambda: EmitTimes(time.time()))


@dataclass
class StrOutput:
    """Detokenizer -> tokenizer manager: one request's step output with the text its new tokens add.

    When a stop string ended the request, `output` is cut after the token that completed it and its
    finish reason says which string matched; `text` never contains the stop string.
    """

    output: ReqOutput
    text: str


@dataclass
class BatchStrOut:
    """Detokenizer -> tokenizer manager: the text outputs of one scheduler step."""

    outputs: list[StrOutput]
    times: EmitTimes


@dataclass
class GenerateError:
    """Scheduler -> tokenizer manager (through the detokenizer): the request was refused or dropped."""

    rid: str
    message: str
    kind: str = "invalid"  # "invalid": a bad request (400); "queue_timeout": waited past --request-timeout (429)


@dataclass
class StatsReq:
    """Ask the scheduler for a `SchedulerStats` snapshot (answered through the detokenizer)."""

    req_id: int


@dataclass
class FlushCacheReq:
    """Ask the scheduler to drop every cached prefix (SGLang's /flush_cache); answered with a FlushCacheResult."""

    req_id: int


@dataclass
class FlushCacheResult:
    req_id: int
    flushed_tokens: int | None  # None: requests were running or waiting, nothing was dropped


@dataclass
class PoolStats:
    """Token counts of one KV pool. free + cached + in_use == total; evictable <= cached."""

    total: int
    free: int
    cached: int
    evictable: int
    in_use: int


@dataclass
class SchedulerStats:
    req_id: int
    num_running: int
    num_waiting: int
    pools: dict[str, PoolStats]
    num_retractions: int
    generated_tokens_total: int  # every token the scheduler sampled, including ones cut by a stop string
    spec_accept_counts: list[int] = field(default_factory=list)  # verify rounds by accepted drafts (MTP)


def combine_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """The server's figures from its data-parallel replicas': every count and pool summed."""
    if len(replicas) == 1:
        return replicas[0]
    first = replicas[0]
    pools = {
        name: PoolStats(*(sum(getattr(r.pools[name], f.name) for r in replicas) for f in fields(PoolStats)))
        for name in first.pools
    }
    return SchedulerStats(
        req_id=first.req_id,
        num_running=sum(r.num_running for r in replicas),
        num_waiting=sum(r.num_waiting for r in replicas),
        pools=pools,
        num_retractions=sum(r.num_retractions for r in replicas),
        generated_tokens_total=sum(r.generated_tokens_total for r in replicas),
        spec_accept_counts=[sum(counts) for counts in zip(*(r.spec_accept_counts for r in replicas), strict=True)],
    )


@dataclass
class SchedulerInfo:
    """What the scheduler process reports once its model is loaded."""

    context_len: int
    vocab_size: int
    max_total_tokens: int
    max_swa_tokens: int
    eos_token_ids: list[int]
    device: str
    dtype: str
