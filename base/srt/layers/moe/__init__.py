"""Mixture-of-experts of Gemma 4 26B-A4B: routing and experts (torch reference; fused Triton on GPU).

- `router.py`: `Router` and `topk_routing_reference` (the CPU path, the oracle, and the tie rule).
- `experts.py`: `Experts` and its torch loop `forward_reference`.
- `fused_routing.py`, `fused_experts.py`: the GPU paths `Router.forward` / `Experts.forward` dispatch to on CUDA.
- `triton_kernels/`: the Triton kernels behind them.
"""
