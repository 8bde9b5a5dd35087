"""Mixture-of-experts of Gemma 4 26B-A4B: routing and experts (torch reference; fused Triton on GPU)."""
