"""`POST /v1/completions`: prompts (strings or token ids, one or a batch) -> text, as OpenAI's legacy API.

`echo` with `logprobs` scores the prompt itself (the first token has no logprob: nothing predicts it); with
`max_tokens: 0` nothing is generated, which is how lm-eval's loglikelihood tasks use the endpoint. The echo
covers the prompt as sent: the `<bos>` the server puts before a text prompt conditions every logprob but is not
echoed, so position i of the echo is token i of the client's own tokenization (lm-eval slices by it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from srt.entrypoints.openai.protocol import CompletionRequest
from srt.entrypoints.openai.response_parts import (
    SSE_DONE,
    RequestError,
    check_model,
    emit_ts,
    finish_reason,
    matched_stop,
    new_id,
    now,
    openai_error,
    sse,
    usage,
)
from srt.managers.generate_input import GenerateReqInput
from srt.managers.generate_output import TokenTexts
from srt.managers.tokenizer_manager import TokenizerManager


class CompletionRun:
    """One checked /v1/completions request, ready to run as a whole response or as an SSE stream."""

    def __init__(self, tm: TokenizerManager, request: CompletionRequest) -> None:
        check_model(tm, request.model)
        if request.suffix:
            raise RequestError("suffix is not supported: Gemma 4 has no insertion mode", param="suffix")
        if request.best_of is not None and request.best_of != 1:
            raise RequestError("best_of is not supported (use n); only best_of 1 is accepted", param="best_of")
        self.tm, self.request = tm, request
        self.prompts = _prompts(request.prompt)
        wants_logprobs = request.logprobs is not None
        texts = self.prompts if isinstance(self.prompts[0], str) else None
        self.obj = GenerateReqInput(
            text=texts,
            input_ids=None if texts is not None else self.prompts,
            sampling_params=request.sampling_params(request.max_tokens),
            return_logprob=wants_logprobs,
            logprob_start_len=0 if wants_logprobs and request.echo else None,
            top_logprobs_num=request.logprobs or 0,
            stream=request.stream,
            return_emit_ts=request.return_emit_ts,
        )
        try:
            self.prepared = tm.prepare(self.obj)
        except ValueError as error:
            raise openai_error(error) from None
        self.id, self.created = new_id("cmpl"), now()

    async def response(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> dict:
        results = await self.tm.generate_all(self.obj, is_disconnected, self.prepared)
        choices = [self._choice(index, result, first=True) for index, result in enumerate(results)]
        return {
            **self._envelope(),
            "choices": choices,
            "usage": usage([r["meta_info"] for r in results], self.request.n),
        }

    async def stream(self) -> AsyncIterator[str]:
        metas: list[dict] = [{}] * len(self.prepared)
        started: set[int] = set()
        chunks = self.tm.generate(self.obj, prepared=self.prepared)
        try:
            async for index, chunk in chunks:
                metas[index] = chunk["meta_info"]
                first = index not in started
                shows = chunk["text"] or self.request.logprobs is not None or (first and self.request.echo)
                if not shows and finish_reason(chunk["meta_info"]) is None:
                    continue  # tokens held back (half a character, a possible stop string): nothing to show yet
                choice = self._choice(index, chunk, first=first)
                started.add(index)
                payload = {**self._envelope(), "choices": [choice]}
                if self.request.return_emit_ts:
                    payload["emit_ts"] = emit_ts(chunk["meta_info"])
                yield sse(payload)
            if self.request.include_usage:
                yield sse({**self._envelope(), "choices": [], "usage": usage(metas, self.request.n)})
            yield SSE_DONE
        finally:
            await chunks.aclose()  # a client that went away aborts what is still running

    def _envelope(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.tm.model_name}

    def _choice(self, index: int, result: dict, first: bool) -> dict:
        """A choice from a whole result or a streamed chunk; `first`: the first piece of this output."""
        meta = result["meta_info"]
        text = result["text"]
        prompt = self.prompts[index // self.request.n]
        if self.request.echo and first:
            text = (prompt if isinstance(prompt, str) else self.tm.tokenizer.decode(prompt)) + text
        logprobs = None
        if self.request.logprobs is not None:
            added = self._added_tokens(index)
            logprobs = completion_logprobs(
                self.tm.token_texts,
                meta.get("input_token_logprobs", [])[added:] + meta["output_token_logprobs"],
                meta.get("input_top_logprobs", [])[added:] + meta.get("output_top_logprobs", []),
                self.request.logprobs,
            )
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(meta),
            "matched_stop": matched_stop(meta),
        }

    def _added_tokens(self, index: int) -> int:
        """1 if the server put a `<bos>` before output `index`'s text prompt (not echoed), else 0."""
        prompt = self.prompts[index // self.request.n]
        bos = self.tm.tokenizer.bos_token_id
        added = isinstance(prompt, str) and not prompt.startswith(self.tm.bos_text)
        return int(added and bos is not None and self.prepared[index].input_ids[:1] == [bos])


def _prompts(prompt: str | list) -> list[str] | list[list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return prompt


def completion_logprobs(texts: TokenTexts, entries: list[list], tops: list, k: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.

    As in vLLM, each position's top_logprobs also holds the chosen token, so `logprobs: 0` still says
    whether the choice was the most likely one.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    seen = b""
    for i, (logprob, token_id, _) in enumerate(entries):
        token = texts.text(token_id)
        tokens.append(token)
        token_logprobs.append(logprob)
        # character offset into the text, which skips special tokens and joins partial characters
        offsets.append(len(seen.decode(errors="ignore")))
        if token_id not in texts.special_ids:
            seen += texts.bytes(token_id)
        if logprob is None:
            top_logprobs.append(None)
            continue
        top = {texts.text(tid): value for value, tid, _ in (tops[i] or [])[:k]} if i < len(tops) else {}
        top.setdefault(token, logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
