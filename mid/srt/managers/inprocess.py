"""Drive a Scheduler in the calling process: tests and offline batch jobs use this; the server and the
Engine drive the same Scheduler from their own process loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.managers.io_struct import FinishReason, ReqOutput, TokenizedGenerateReq, TokenLogprob
from srt.managers.scheduler import Scheduler


@dataclass
class GenerationResult:
    """Everything one request produced, gathered from its step outputs."""

    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    def add(self, output: ReqOutput) -> None:
        self.output_ids.extend(output.new_token_ids)
        self.output_logprobs.extend(output.output_logprobs)
        self.input_logprobs.extend(output.input_logprobs)
        self.finished_reason = output.finished_reason
        self.prompt_tokens = output.prompt_tokens
        self.cached_tokens = output.cached_tokens
        self.spec_verify_ct = output.spec_verify_ct
        self.spec_accepted_tokens = output.spec_accepted_tokens


def run_to_completion(scheduler: Scheduler, requests: list[TokenizedGenerateReq]) -> dict[str, GenerationResult]:
    """Queue every request, step until all are finished, and return their results by rid."""
    results = {request.rid: GenerationResult() for request in requests}
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_work():
        for output in scheduler.step():
            results[output.rid].add(output)
    return results
