"""transformers' Gemma 4 timed on the same device, dtype and prompts as srt: the baseline of bench_one_batch.

The figures mirror srt's `generate_greedy`: wall time of each forward until its greedy ids are on the host
(the copy synchronises the device), prefill = one forward over the whole batch with `use_cache=True` (logits of
the last row only, as `generate` asks), decode = one token per request per step fed with the KV cache the
previous forward returned (`past_key_values`), greedy.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm
from transformers.models.gemma4 import Gemma4ForCausalLM

from srt.configs.model_config import ModelConfig


def build_transformers_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, checkpoint: Path | None = None
) -> Gemma4ForCausalLM:
    """The text model with SDPA attention on `device` in `dtype`: the checkpoint's weights, or random ones.

    Random weights are built on the meta device and materialised once on `device` (no float32 or host copy:
    26B-A4B and 31B are 50-60 GB in bf16), then filled by transformers' own initialisation, which also
    computes the non-persistent buffers (RoPE frequencies, embedding scales) that `to_empty` leaves unset.
    """
    if checkpoint is not None:
        # straight onto the device needs accelerate; without it the weights pass through host memory once
        device_map = device if importlib.util.find_spec("accelerate") is not None else None
        model = Gemma4ForCausalLM.from_pretrained(
            checkpoint, dtype=dtype, attn_implementation="sdpa", device_map=device_map
        )
        return model.to(device).eval()
    hf_config = copy.deepcopy(config.hf_text_config)
    with torch.device("meta"):
        model = Gemma4ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
    model = model.to_empty(device=device)
    model.init_weights()  # random values; re-ties the LM head to embed_tokens, which to_empty untied
    return model.eval()


class GreedyRun(NamedTuple):
    step_seconds: list[float]  # prefill first, then one per decode step
    output_ids: list[list[int]]  # greedy tokens per prompt (the prefill's, then one per decode step)


@torch.inference_mode()
def greedy_steps(model: Gemma4ForCausalLM, prompts: list[list[int]], output_len: int) -> GreedyRun:
    """One prefill of `prompts` (equal lengths, no padding) and `output_len` greedy decode steps."""
    device = model.device
    input_ids = torch.tensor(prompts, device=device)
    seconds: list[float] = []
    start = time.perf_counter()
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    next_ids = out.logits[:, -1].float().argmax(dim=-1)
    tokens = next_ids.tolist()  # the copy synchronises the device; srt's steps end the same way
    seconds.append(time.perf_counter() - start)
    outputs = [[token] for token in tokens]
    for _ in range(output_len):
        step_ids = next_ids[:, None].to(device)  # outside the timed region, as srt builds its batch outside it
        start = time.perf_counter()
        out = model(input_ids=step_ids, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].float().argmax(dim=-1)
        tokens = next_ids.tolist()
        seconds.append(time.perf_counter() - start)
        for output, token in zip(outputs, tokens):
            output.append(token)
    return GreedyRun(seconds, outputs)


def time_transformers(model: Gemma4ForCausalLM, batches: list[list[list[int]]], output_len: int) -> list[GreedyRun]:
    """Per batch: the second of two runs (the first warms up kernels and the allocator, as srt's does)."""
    runs = []
    for prompts in tqdm(batches, desc="transformers batches", disable=None):
        greedy_steps(model, prompts, output_len)
        runs.append(greedy_steps(model, prompts, output_len))
    return runs
