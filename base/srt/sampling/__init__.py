"""Sampling: what a request asks for (`SamplingParams`) and the batched sampler (`sampler.py`)."""

from __future__ import annotations

from srt.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
