"""Attention backends over paged KV: `torch_native` (reference, CPU default) and `triton` (GPU default)."""

from __future__ import annotations

from srt.layers.attention.base import AttentionBackend


def create_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name`."""
    if name == "torch_native":
        from srt.layers.attention.torch_native import TorchNativeAttentionBackend

        return TorchNativeAttentionBackend()
    if name == "triton":
        from srt.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch_native, triton")
