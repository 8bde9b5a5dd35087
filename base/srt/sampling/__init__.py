"""What a request asks of sampling: `SamplingParams`. The batched sampler itself is `srt.layers.sampler`."""

from __future__ import annotations

from srt.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
