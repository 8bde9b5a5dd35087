"""Per-layer K/V buffers that know which layer owns the KV each layer reads.

Gemma 4 layers differ in shape (sliding: head_dim 256, full: head_dim 512 and, on 26B/31B, fewer KV heads),
so each owning layer gets its own buffer pair. KV-shared layers (the last `num_kv_shared_layers` of E2B/E4B)
get none: asking for their buffers returns their owner's. Full-attention layers are indexed by full-pool
slots; sliding layers by SWA-pool slots, reached through the allocator's `full_to_swa`.

Buffers hold the model's dtype, or float8_e4m3fn with two float32 per-tensor scales per KV-owning layer
(`--kv-cache-dtype fp8_e4m3`, `kv_cache_dtype.py`). The scales live here beside the buffers, so a reader gets
them the way it gets the buffers: a KV-shared layer, or the MTP assistant's, asks for its own layer id and
gets its owner's (`kv_scales`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from srt.configs.model_config import AttentionLayerSpec
from srt.kernels.kv_quant import is_fp8_kv, write_rows
from srt.mem_cache.allocator import SWATokenAllocator, check_indices, debug_kv_indices
from srt.mem_cache.kv_cache_dtype import UNIT_SCALES, KVScales, as_float32


@dataclass(frozen=True)
class KVCacheTarget:
    """Where a layer's new K/V go, for kernels that write them themselves: the layer's buffers and, on
    sliding layers, the full -> SWA slot table that maps a token's full slot to its buffer row."""

    k_buffer: torch.Tensor  # [rows, kv_heads, head_dim]
    v_buffer: torch.Tensor
    full_to_swa: torch.Tensor | None  # None on full-attention layers: their rows are the full slots
    scales: KVScales = UNIT_SCALES  # stored = value / scale (FP8 buffers; 1.0 otherwise)

    def rows(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Buffer rows of the tokens with these full slots (checked under SRT_DEBUG_KV_INDICES=1)."""
        if self.full_to_swa is None:
            if debug_kv_indices():
                check_indices(full_slots, self.k_buffer.shape[0] - 1, "full")
            return full_slots
        if debug_kv_indices():
            check_indices(full_slots, len(self.full_to_swa) - 1, "full")
        rows = self.full_to_swa[full_slots]
        if debug_kv_indices():
            check_indices(rows, self.k_buffer.shape[0] - 1, "swa")
        return rows

    def store(self, full_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of the tokens with these full slots ([tokens, kv_heads, head_dim]) in the buffers' dtype
        (FP8 buffers: quantized with the layer's scales)."""
        rows = self.rows(full_slots)
        write_rows(self.k_buffer, rows, k, self.scales.k)
        write_rows(self.v_buffer, rows, v, self.scales.v)


class HybridKVPool:
    """K/V buffers for every KV-owning layer; full layers in the full pool, sliding layers in the SWA pool."""

    def __init__(
        self,
        layers: Sequence[AttentionLayerSpec],
        allocator: SWATokenAllocator,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: Mapping[int, KVScales] | None = None,
    ) -> None:
        """`dtype`: the buffers' element dtype; `scales`: per KV-owning layer id, the (k, v) scales of an FP8
        pool (layers not named get 1.0). Only an FP8 pool takes scales."""
        self.layers = tuple(layers)
        self.allocator = allocator
        self.dtype = dtype
        self.device = torch.device(device)
        scales = dict(scales or {})
        if scales and not is_fp8_kv(dtype):
            raise ValueError(f"KV scales are for FP8 KV buffers; these are {dtype}")
        for layer_id, (k_scale, v_scale) in scales.items():
            if layer_id >= len(self.layers) or not self.layers[layer_id].owns_kv:
                raise ValueError(f"KV scales given for layer {layer_id}, which owns no KV buffers")
            if not (k_scale > 0 and v_scale > 0 and torch.isfinite(torch.tensor([k_scale, v_scale])).all()):
                raise ValueError(f"layer {layer_id}: KV scales must be finite and > 0; got {k_scale}, {v_scale}")
        self._scales = {
            spec.layer_id: KVScales(*(as_float32(x) for x in scales.get(spec.layer_id, UNIT_SCALES)))
            for spec in self.layers
            if spec.owns_kv
        }
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        for spec in self.layers:
            if spec.owns_kv:
                self._k[spec.layer_id] = self._zeros(self._buffer_shape(spec))
                self._v[spec.layer_id] = self._zeros(self._buffer_shape(spec))

    def _zeros(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """A zeroed buffer; FP8 ones as zeroed bytes (0x00 is +0.0), which needs no float8 fill kernel."""
        if is_fp8_kv(self.dtype):
            return torch.zeros(shape, dtype=torch.uint8, device=self.device).view(self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _buffer_shape(self, spec: AttentionLayerSpec) -> tuple[int, int, int]:
        """[slots of the layer's pool + padding slot 0, kv_heads, head_dim]."""
        rows = (self.allocator.swa_size if spec.is_sliding else self.allocator.full_size) + 1
        return (rows, spec.num_kv_heads, spec.head_dim)

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) buffers layer `layer_id` reads: its own, or its owner's for a KV-shared layer."""
        owner = self.layers[layer_id].kv_owner
        return self._k[owner], self._v[owner]

    def kv_scales(self, layer_id: int) -> KVScales:
        """The scales of the buffers layer `layer_id` reads (its owner's for a KV-shared layer): a reader
        dequantizes with value = stored * scale. 1.0 on pools that are not FP8."""
        return self._scales[self.layers[layer_id].kv_owner]

    @property
    def quantized(self) -> bool:
        """Whether the buffers hold FP8 with scales."""
        return is_fp8_kv(self.dtype)

    def cache_target(self, layer_id: int) -> KVCacheTarget:
        """The buffers and slot table a KV-owning layer's fused kernel writes new K/V through."""
        if not self.layers[layer_id].owns_kv:
            raise ValueError(f"layer {layer_id} shares KV of layer {self.layers[layer_id].kv_owner}")
        sliding = self.layers[layer_id].is_sliding
        full_to_swa = self.allocator.full_to_swa if sliding else None
        return KVCacheTarget(self._k[layer_id], self._v[layer_id], full_to_swa, self._scales[layer_id])

    def layer_slots(self, layer_id: int, full_slots: torch.Tensor) -> torch.Tensor:
        """Rows of the layer's buffers (its owner's, for a KV-shared layer) holding these full-pool slots."""
        return self.cache_target(self.layers[layer_id].kv_owner).rows(full_slots)

    def write(self, layer_id: int, full_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens ([tokens, kv_heads, head_dim]) for a KV-owning layer."""
        self.cache_target(layer_id).store(full_slots, k, v)

    def check_integrity(self) -> None:
        """Raise AssertionError unless exactly the KV-owning layers have buffers, sized to their pool, and
        every KV-shared layer reads an earlier owning layer of its own type and shape."""
        owners = {spec.layer_id for spec in self.layers if spec.owns_kv}
        if set(self._k) != owners or set(self._v) != owners:
            raise AssertionError(f"buffers for layers {sorted(self._k)}, but layers {sorted(owners)} own KV")
        if set(self._scales) != owners:
            raise AssertionError(f"scales for layers {sorted(self._scales)}, but layers {sorted(owners)} own KV")
        if not self.quantized and any(scales != UNIT_SCALES for scales in self._scales.values()):
            raise AssertionError(f"{self.dtype} KV buffers with scales other than 1.0")
        for spec in self.layers:
            owner = self.layers[spec.kv_owner]
            if not owner.owns_kv or owner.layer_id > spec.layer_id or owner.layer_type != spec.layer_type:
                raise AssertionError(f"layer {spec.layer_id} reads KV of layer {owner.layer_id}, not a valid owner")
            shape = self._buffer_shape(spec)
            for name, buffer in (("K", self._k[owner.layer_id]), ("V", self._v[owner.layer_id])):
                if tuple(buffer.shape) != shape or buffer.dtype != self.dtype:
                    raise AssertionError(
                        f"layer {spec.layer_id} {name} buffer is {tuple(buffer.shape)} {buffer.dtype}, "
                        f"expected {shape} {self.dtype}"
                    )
        self.allocator.check_integrity()


def layer_kv_bytes(spec: AttentionLayerSpec, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in one layer."""
    return 2 * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def kv_bytes_per_token(layers: Sequence[AttentionLayerSpec], dtype: torch.dtype) -> tuple[int, int]:
    """(full, swa) bytes per token of K and V over the layers that own KV."""
    owners = [spec for spec in layers if spec.owns_kv]
    full = sum(layer_kv_bytes(spec, dtype) for spec in owners if not spec.is_sliding)
    swa = sum(layer_kv_bytes(spec, dtype) for spec in owners if spec.is_sliding)
    return full, swa
