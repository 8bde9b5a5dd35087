"""Batched next-token sampling with per-request parameters, penalties, seeds and logprobs.

One step, for each row of `logits` [B, V] (float32, already softcapped; never modified here):

    raw logits ──► logprobs / top_logprobs: log_softmax of the RAW logits (what OpenAI and SGLang report)
        │
        ▼  + logit_bias; repetition, frequency, presence penalties; -inf on EOS / stop_token_ids while under
        │  min_new_tokens
    penalised ──► greedy rows: argmax (ties -> lowest id)
        │
        ▼  / temperature, then top-k, top-p (on the renormalised top-k set), min-p
    probs ─────► sampled rows: argmax(probs / E), E ~ Exp(1) drawn from the row's own generator

Drawing with exponential noise (the "exponential race", as vLLM does) instead of torch.multinomial lets every
seeded row draw from its own generator without a host sync, and makes a seeded row's tokens depend only on its
own logits and generator, never on its batch neighbours.

Caller state: a `SamplingBatch` (built once per batch composition) and, when any request uses penalties or
min_new_tokens, a `PenaltyState` (built with the batch, `record()`ed after every step). See their docstrings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from srt.forward.host_device import fill_at, host_to_device
from srt.sampling.sampling_params import SamplingParams


class TopLogprobs(NamedTuple):
    ids: torch.Tensor  # [N, k] int64, most likely first
    values: torch.Tensor  # [N, k] float32 logprobs, descending


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 raw logprob of next_token_ids; None unless return_logprob
    top_logprobs: TopLogprobs | None  # None unless top_logprobs_num > 0


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request keeps for its whole life and hands to every `SamplingBatch.build`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Per-request sampling parameters as device tensors, built once per batch composition.

    Rebuild it whenever requests join, leave or change order; rows follow `params` order. Greedy rows carry
    neutral values (temperature 1, no filtering) so they never force the sampled rows' work. The `use_*` host
    flags let `sample` skip passes no request needs, without reading device tensors.
    """

    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor  # [B, 1] float32
    top_ks: torch.Tensor  # [B] int64, in [1, vocab_size]
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B, 1] float32
    frequency_penalties: torch.Tensor  # [B, 1] float32
    presence_penalties: torch.Tensor  # [B, 1] float32
    min_new_tokens: torch.Tensor  # [B] int64
    is_greedy: torch.Tensor  # [B] bool
    # (row, token) pairs set to -inf while the row has fewer than min_new_tokens outputs: EOS and stop ids
    ban_rows: torch.Tensor  # [K] int64
    ban_ids: torch.Tensor  # [K] int64
    # (row, token, bias) of every request's logit_bias, added to the logits before anything else
    bias_rows: torch.Tensor  # [L] int64
    bias_ids: torch.Tensor  # [L] int64
    bias_values: torch.Tensor  # [L] float32
    generators: tuple[torch.Generator | None, ...]  # per row; None (and greedy) rows use default_generator
    default_generator: torch.Generator | None  # None: torch's global generator of the device
    any_greedy: bool
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_repetition: bool
    use_frequency: bool
    use_presence: bool
    use_min_new_tokens: bool
    use_logit_bias: bool

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @property
    def needs_penalty_state(self) -> bool:
        """Whether `sample` needs a `PenaltyState` (some request uses a penalty or min_new_tokens)."""
        return self.use_repetition or self.use_frequency or self.use_presence or self.use_min_new_tokens

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        generators: Sequence[torch.Generator | None] | None = None,
        default_generator: torch.Generator | None = None,
    ) -> SamplingBatch:
        """Tensors for `params` (already validated). `generators[i]` is request i's own generator (from
        `make_generator`) when it has a seed, else None; `eos_token_ids` are the model's EOS ids."""
        device = torch.device(device)
        gens = tuple(generators) if generators is not None else (None,) * len(params)
        if len(gens) != len(params):
            raise ValueError(f"got {len(gens)} generators for {len(params)} requests")
        greedy = [p.is_greedy for p in params]
        # A greedy row never uses its draw, so its generator is left alone (not advanced).
        gens = tuple(None if g else gen for gen, g in zip(gens, greedy, strict=True))
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        # Greedy rows get neutral values: their temperature may be 0 and their top_k 1.
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)]
        top_ks = [vocab_size if g else p.effective_top_k(vocab_size) for p, g in zip(params, greedy, strict=True)]
        top_ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy, strict=True)]
        min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy, strict=True)]
        ban = sorted(
            {(row, tok) for row, p in enumerate(params) if p.min_new_tokens > 0 for tok in _ban_ids(p, eos_token_ids)}
        )
        biases = [(row, tok, bias) for row, p in enumerate(params) for tok, bias in p.token_biases.items()]

        # two pinned copies (floats, ints): a torch.tensor(..., device="cuda") per field would wait for the
        # device each time, and a sampler is built whenever a batch's requests change
        temperatures, top_ps_t, min_ps_t, repetition, frequency, presence, bias_values = host_to_device(
            [
                temps,
                top_ps,
                min_ps,
                [float(p.repetition_penalty) for p in params],
                [float(p.frequency_penalty) for p in params],
                [float(p.presence_penalty) for p in params],
                [bias for _, _, bias in biases],
            ],
            device,
            dtype=torch.float32,
        )
        top_ks_t, min_new_tokens, is_greedy, ban_rows, ban_ids, bias_rows, bias_ids = host_to_device(
            [
                top_ks,
                [p.min_new_tokens for p in params],
                greedy,
                [row for row, _ in ban],
                [tok for _, tok in ban],
                [row for row, _, _ in biases],
                [tok for _, tok, _ in biases],
            ],
            device,
        )
        return cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=temperatures[:, None],
            top_ks=top_ks_t,
            top_ps=top_ps_t,
            min_ps=min_ps_t,
            repetition_penalties=repetition[:, None],
            frequency_penalties=frequency[:, None],
            presence_penalties=presence[:, None],
            min_new_tokens=min_new_tokens,
            is_greedy=is_greedy.bool(),
            ban_rows=ban_rows,
            ban_ids=ban_ids,
            bias_rows=bias_rows,
            bias_ids=bias_ids,
            bias_values=bias_values,
            generators=gens,
            default_generator=default_generator,
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            use_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy, strict=True) if not g),
            use_top_p=any(p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            use_repetition=any(p.repetition_penalty != 1.0 for p in params),
            use_frequency=any(p.frequency_penalty != 0.0 for p in params),
            use_presence=any(p.presence_penalty != 0.0 for p in params),
            use_min_new_tokens=bool(ban),
            use_logit_bias=bool(biases),
        )


def _ban_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    return set(eos_token_ids) | set(params.stop_token_ids or ())


@dataclass(eq=False)
class PenaltyState:
    """Each request's token history on device, for penalties and min_new_tokens. Owned by the caller.

    Build it together with the `SamplingBatch` (same rows, same order) from each request's prompt and output
    ids so far, and call `record(next_token_ids)` after every `sample` step, so the history stays in sync
    without a host round trip. Only what the batch uses is allocated ([B, V] tensors are large).
    """

    output_lens: torch.Tensor  # [B] int64: tokens generated so far
    output_token_counts: torch.Tensor | None  # [B, V] int32: occurrences in the output (frequency, presence)
    seen_mask: torch.Tensor | None  # [B, V] bool: in the prompt or the output (repetition penalty)

    @classmethod
    def build(
        cls, batch: SamplingBatch, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]
    ) -> PenaltyState:
        """History of `batch`'s requests: `prompt_ids[i]` and `output_ids[i]` are request i's tokens so far."""
        if not len(prompt_ids) == len(output_ids) == batch.batch_size:
            raise ValueError(f"need prompt and output ids of {batch.batch_size} requests")
        shape, device = (batch.batch_size, batch.vocab_size), batch.device
        counts = None
        if batch.use_frequency or batch.use_presence:
            counts = torch.zeros(shape, dtype=torch.int32, device=device)
            rows, ids = _flatten(output_ids, device)
            counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        seen = None
        if batch.use_repetition:
            seen = torch.zeros(shape, dtype=torch.bool, device=device)
            rows, ids = _flatten([[*p, *o] for p, o in zip(prompt_ids, output_ids, strict=True)], device)
            fill_at(seen, (rows, ids), True)
        (lens,) = host_to_device([[len(o) for o in output_ids]], device)
        return cls(output_lens=lens, output_token_counts=counts, seen_mask=seen)

    def record(self, next_token_ids: torch.Tensor) -> None:
        """Append one sampled token per row (in place), i.e. `sample(...).next_token_ids`."""
        ids = next_token_ids.view(-1, 1)
        self.output_lens += 1
        if self.output_token_counts is not None:
            self.output_token_counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
        if self.seen_mask is not None:
            self.seen_mask.scatter_(1, ids, True)


def _flatten(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [row for row, seq in enumerate(ids) for _ in seq]
    flat = [tok for seq in ids for tok in seq]
    rows_tensor, flat_tensor = host_to_device([rows, flat], device)
    return rows_tensor, flat_tensor


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    penalty_state: PenaltyState | None = None,
    top_logprobs_num: int = 0,
    return_logprob: bool = True,
    greedy_ids: torch.Tensor | None = None,
) -> SampleOutput:
    """Pick one token per row of `logits` [B, V] float32 (left unmodified).

    `penalty_state` is required when `batch.needs_penalty_state`. `top_logprobs_num` is the batch's largest
    request; slice each row to its own request's count. Logprobs are of the raw logits, before penalties and
    temperature. Seeded rows advance their generator by one draw of V values per step; greedy rows draw nothing.
    `greedy_ids` [B]: each row's argmax of `logits` where the caller has it (`LogitsOutput.greedy_ids`); greedy
    rows without penalties take it instead of an argmax of their own.
    """
    if logits.shape != (batch.batch_size, batch.vocab_size):
        raise ValueError(f"logits shape {tuple(logits.shape)} != ({batch.batch_size}, {batch.vocab_size})")
    if batch.needs_penalty_state and penalty_state is None:
        raise ValueError("this batch uses penalties or min_new_tokens: pass its PenaltyState")
    raw_logprobs = torch.log_softmax(logits, dim=-1) if return_logprob or top_logprobs_num > 0 else None

    penalised = logits
    if batch.needs_penalty_state or batch.use_logit_bias:
        penalised, greedy_ids = apply_penalties(logits, batch, penalty_state), None
    if batch.any_greedy and greedy_ids is None:
        greedy_ids = penalised.argmax(dim=-1)
    if batch.all_greedy:
        next_ids = greedy_ids
    else:
        next_ids = _draw(filtered_probs(penalised, batch), batch)
        if batch.any_greedy:
            next_ids = torch.where(batch.is_greedy, greedy_ids, next_ids)

    logprobs = None
    top = None
    if raw_logprobs is not None:
        if return_logprob:
            logprobs = raw_logprobs.gather(1, next_ids[:, None]).squeeze(1)
        if top_logprobs_num > 0:
            values, ids = raw_logprobs.topk(min(top_logprobs_num, batch.vocab_size), dim=-1)
            top = TopLogprobs(ids=ids, values=values)
    return SampleOutput(next_token_ids=next_ids, logprobs=logprobs, top_logprobs=top)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, state: PenaltyState | None) -> torch.Tensor:
    """Penalised copy of `logits` [B, V]: + logit_bias (OpenAI's: on the model's logits), then repetition (seen
    tokens: logit > 0 divided, else multiplied), `- frequency * count`, `- presence * (count > 0)`, then -inf on
    EOS / stop ids of rows under min_new_tokens. Neutral rows come out unchanged. `state` is needed when
    `batch.needs_penalty_state`."""
    out = logits.clone()
    if batch.use_logit_bias:
        out.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
    if batch.use_repetition:
        # HF / SGLang: a seen token's logit moves toward "less likely" whatever its sign.
        pen = torch.where(state.seen_mask, batch.repetition_penalties, 1.0)
        out = torch.where(out > 0, out / pen, out * pen)
    if batch.use_frequency:
        out -= batch.frequency_penalties * state.output_token_counts
    if batch.use_presence:
        out -= batch.presence_penalties * (state.output_token_counts > 0)
    if batch.use_min_new_tokens:
        under = (state.output_lens < batch.min_new_tokens)[batch.ban_rows]
        current = out[batch.ban_rows, batch.ban_ids]
        out[batch.ban_rows, batch.ban_ids] = torch.where(under, float("-inf"), current)
    return out


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """softmax(logits / T) restricted to top-k, then top-p of what is left, then min-p; rows sum to 1."""
    scaled = logits / batch.temperatures
    if batch.use_top_k or batch.use_top_p:
        # Stable sort: among equal logits the lower id ranks first, as in argmax.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        if batch.use_top_k:
            ranks = torch.arange(batch.vocab_size, device=logits.device)
            sorted_logits.masked_fill_(ranks >= batch.top_ks[:, None], float("-inf"))
        if batch.use_top_p:
            # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below.
            # Rows with top_p == 1 are exempt, so float rounding of the cumsum never trims their tail.
            probs_sorted = sorted_logits.softmax(dim=-1)
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            drop = (mass_before >= batch.top_ps[:, None]) & (batch.top_ps < 1.0)[:, None]
            sorted_logits.masked_fill_(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    if batch.use_min_p:
        # Relative to the top probability, so the threshold is the same before or after renormalising.
        threshold = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row with probability proportional to `probs` (rows need not sum to 1)."""
    noise = torch.empty_like(probs)
    own = [(row, gen) for row, gen in enumerate(batch.generators) if gen is not None]
    if len(own) < batch.batch_size:
        noise.exponential_(generator=batch.default_generator)
    for row, gen in own:
        noise[row].exponential_(generator=gen)
    # Exp(1) can round to 0: p / 0 would be inf (or NaN for p == 0) and win argmax.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[N] log_softmax(logits)[i, token_ids[i]] of raw logits [N, V]: prompt logprobs, chunk by chunk."""
    # logsumexp avoids materialising a second [N, V] log_softmax tensor.
    return logits.gather(1, token_ids.view(-1, 1).long()).squeeze(1) - logits.logsumexp(dim=-1)


def top_logprobs(logits: torch.Tensor, k: int) -> TopLogprobs:
    """The k most likely tokens of each row of raw logits [N, V], with their logprobs, descending."""
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return TopLogprobs(ids=ids, values=values - logits.logsumexp(dim=-1, keepdim=True))
