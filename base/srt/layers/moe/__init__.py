"""Mixture-of-experts of Gemma 4 26B-A4B: routing and experts (torch reference; fused Triton on GPU).

- `router.py`: `Router` (its top-k routing: `kernels/moe/routing.py`, with the torch reference and tie rule).
- `experts.py`: `Experts` and its torch loop `forward_reference`; `quantize_fp8()` makes its weights FP8
  (weight-only, per output channel).
- `fused_experts.py`: the GPU path `Experts.forward` dispatches to on CUDA: the Triton grouped GEMMs of
  `kernels/moe/` or torch's grouped_mm, whichever is faster for the batch (FP8 weights: triton only).
"""
