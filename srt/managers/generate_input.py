"""A generate request as users send it (SGLang's `/generate` shape), and its split into single requests.

One request may carry a batch (`text` or `input_ids` as a list) and ask for `n` samples of each prompt;
`expand()` turns it into one `SingleReq` per output, in output order (prompt-major), checking the shape
of every field and naming the one that is wrong.
"""

from __future__ import annotations

import numbers
import uuid
from dataclasses import dataclass, field
from typing import Any

# Most samples of one prompt (SGLang and vLLM bound n too). Checked before the request is split, so a huge n
# costs nothing: an unbounded one once froze the HTTP process while it built billions of requests.
MAX_N = 128
SEED_SPAN = 2**64  # a seeded request's n samples use seed, seed + 1, ... modulo this (the generator's range)


@dataclass
class GenerateReqInput:
    """Everything `/generate` and `Engine.generate` accept.

    Exactly one of `text` and `input_ids` is given. A list of strings (or of token-id lists) is a batch;
    `sampling_params`, `return_logprob`, `logprob_start_len` and `top_logprobs_num` are then either one
    value for all or a list with one value per prompt. `sampling_params["n"]` > 1 asks for n samples of
    each prompt. `logprob_start_len` (with `return_logprob`) asks for prompt logprobs from that position;
    None or -1: none.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | None | list[int | None] = None
    top_logprobs_num: int | list[int] = 0
    stream: bool = False
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    # the chat endpoint's prompts come from the chat template, which already starts with <bos>
    add_special_tokens: bool = True
    # streamed chunks carry meta_info["emit_ts"]: when the step's tokens left each process (io_struct.EmitTimes)
    return_emit_ts: bool = False
    # images of the prompt, one per `<|image|>` of its text, in order: PIL images, data: URLs, base64 strings or
    # local paths (multimodal/media.py); a list of such lists for a batch
    image_data: Any = None
    # videos of the prompt, one per `<|video|>` of its text, in order (multimodal/media.load_video); a list of such
    # lists for a batch
    video_data: Any = None
    # the processors' per-request settings: {"max_soft_tokens": 70 | 140 | 280 | 560 | 1120, "num_frames": n}
    mm_processor_kwargs: dict[str, Any] | None = None

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return not isinstance(self.text, str)
        return isinstance(self.input_ids, list) and bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def num_prompts(self) -> int:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        if self.text is not None:
            if isinstance(self.text, str):
                return 1
            if not isinstance(self.text, list) or not self.text or not all(isinstance(t, str) for t in self.text):
                raise ValueError("text must be a string or a non-empty list of strings")
            return len(self.text)
        if not isinstance(self.input_ids, list) or not self.input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")
        if not self.is_batch:
            _check_ids(self.input_ids)
            return 1
        for ids in self.input_ids:
            _check_ids(ids)
        return len(self.input_ids)

    def expand(self) -> list[SingleReq]:
        """One SingleReq per output; ValueError naming the first malformed field."""
        for name in ("stream", "return_emit_ts", "add_special_tokens", "return_text_in_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        num = self.num_prompts()
        params = _per_prompt("sampling_params", self.sampling_params, num, self.is_batch)
        return_logprob = _per_prompt("return_logprob", self.return_logprob, num, self.is_batch)
        start = _per_prompt("logprob_start_len", self.logprob_start_len, num, self.is_batch)
        top = _per_prompt("top_logprobs_num", self.top_logprobs_num, num, self.is_batch)
        rids = _per_prompt("rid", self.rid, num, self.is_batch)
        images = _images_per_prompt(self.image_data, num, self.is_batch)
        videos = _images_per_prompt(self.video_data, num, self.is_batch, "video_data", "a video")
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be an object, got {self.mm_processor_kwargs!r}")
        for i in range(num):  # every n first: nothing is built for a request that asks for too many
            if not isinstance(params[i] or {}, dict):
                raise ValueError(f"sampling_params must be an object, got {params[i]!r}")
            _check_int("n", (params[i] or {}).get("n", 1), low=1, high=MAX_N)
        singles = []
        for i in range(num):
            sampling = dict(params[i] or {})
            n = sampling.pop("n", 1)
            if not isinstance(return_logprob[i], bool):
                raise ValueError(f"return_logprob must be a bool, got {return_logprob[i]!r}")
            _check_int("top_logprobs_num", top[i], low=0)
            if start[i] is not None:
                _check_int("logprob_start_len", start[i], low=-1)
            if rids[i] is not None and not isinstance(rids[i], str):
                raise ValueError(f"rid must be a string (one per prompt for a batch), got {rids[i]!r}")
            base_rid = rids[i] or uuid.uuid4().hex
            for j in range(n):
                sample = dict(sampling)
                if j and isinstance(sample.get("seed"), numbers.Integral):
                    # n samples of one seeded request differ, reproducibly; the seed itself is checked later
                    sample["seed"] = (sample["seed"] + j) % SEED_SPAN
                singles.append(
                    SingleReq(
                        index=len(singles),
                        rid=base_rid if n == 1 else sample_rid(base_rid, j),
                        text=_item(self.text, i) if self.is_batch else self.text,
                        input_ids=_item(self.input_ids, i) if self.is_batch else self.input_ids,
                        sampling_params=sample,
                        return_logprob=return_logprob[i],
                        logprob_start_len=None if start[i] in (None, -1) else start[i],
                        top_logprobs_num=top[i],
                        image_data=images[i],
                        video_data=videos[i],
                        mm_processor_kwargs=self.mm_processor_kwargs,
                    )
                )
        return singles

    def returns_list(self) -> bool:
        """Whether the answer is a list (a batch, or n > 1) rather than one result."""
        params = self.sampling_params
        n = params.get("n", 1) if isinstance(params, dict) else 1
        return self.is_batch or n != 1

    def answer(self, results: list[dict]) -> dict | list[dict]:
        """The reply to this request from its results in output order: the list, or its one result."""
        return results if self.returns_list() else results[0]

    def stream_chunk(self, index: int, chunk: dict) -> dict:
        """A streamed chunk as users get it: labelled with its output `index` when the reply is a list."""
        return {**chunk, "index": index} if self.returns_list() else chunk


@dataclass
class SingleReq:
    """One prompt, one output."""

    index: int
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    image_data: list[Any] | None = None
    video_data: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


def _images_per_prompt(
    image_data: Any, num: int, is_batch: bool, name: str = "image_data", one: str = "an image"
) -> list[list[Any] | None]:
    """Each prompt's list of images (or videos; None: none)."""
    if image_data is None:
        return [None] * num
    if not is_batch:
        return [list(image_data) if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != num:
        raise ValueError(f"{name} must have one entry ({one} or a list of them) for each of {num} prompts")
    return [None if x is None else list(x) if isinstance(x, list) else [x] for x in image_data]


def _item(values: list | None, i: int) -> Any:
    return None if values is None else values[i]


def _per_prompt(name: str, value: Any, num: int, is_batch: bool) -> list[Any]:
    if is_batch and isinstance(value, list):
        if len(value) != num:
            raise ValueError(f"{name} has {len(value)} entries for {num} prompts")
        return value
    return [value] * num


def _check_ids(ids: object) -> None:
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids")
    if all(type(tok) is int for tok in ids):  # JSON's ids: 10x faster than the ABC check (8k ids: 0.2 ms)
        return
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise ValueError(f"input_ids must hold ints, got {tok!r}")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}")


def sample_rid(base: str, index: int) -> str:
    """The rid of sample `index` of a request `base` asking for n > 1 samples."""
    return f"{base}-{index}"


def is_sample_of(rid: str, base: str) -> bool:
    """Whether `rid` is one of the samples `sample_rid` names for request `base` (`base-0`, `base-1`, ...)."""
    return rid.startswith(base + "-") and rid[len(base) + 1 :].isdigit()
