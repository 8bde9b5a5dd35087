"""Per-tensor K/V cache scales of an FP8-KV checkpoint (`--kv-cache-dtype fp8_e4m3`).

Exports that calibrate the KV cache store one float32 scalar per layer for K and one for V, under the names
vLLM accepts (its loader remaps all of them to the attention layer's `k_scale` / `v_scale`):

    model.layers.N.self_attn.k_scale, .v_scale              compressed-tensors (kv_cache_scheme)
    model.layers.N.self_attn.k_proj.output_scale, v_proj.   compressed-tensors / ModelOpt output activations
    model.layers.N.self_attn.k_proj.k_scale, v_proj.v_scale ModelOpt
    model.layers.N.self_attn.kv_scale                       deprecated: one scale for both

(with `model.language_model.` in place of `model.` in multimodal checkpoints). They are not parameters of the
model: the loader leaves them to this module, and the pool gets them (`HybridKVPool(scales=...)`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from safetensors import safe_open

from srt.mem_cache.kv_cache_dtype import DEFAULT_KV_SCALE, KVScales

logger = logging.getLogger(__name__)

_KV_SCALE_NAME = re.compile(
    r"model\.(?:language_model\.)?layers\.(\d+)\.self_attn\."
    r"(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale|k_proj\.k_scale|v_proj\.v_scale)$"
)


def kv_scale_target(checkpoint_name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") for a checkpoint tensor that is a KV cache scale, else None."""
    match = _KV_SCALE_NAME.match(checkpoint_name)
    if match is None:
        return None
    suffix = match.group(2)
    which = "kv" if suffix == "kv_scale" else suffix[0]
    return int(match.group(1)), which


def read_kv_scales(files: list[Path], owners: set[int]) -> dict[int, KVScales]:
    """KV scales by layer for the KV-owning layers `owners`, from the checkpoint's safetensors `files`; a layer
    with only one of the two gets DEFAULT_KV_SCALE for the other. Scales of layers that own no KV (exports may
    keep them for KV-shared layers, which never write) are ignored. ValueError for a non-scalar or
    non-positive scale."""
    found: dict[int, dict[str, float]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                target = kv_scale_target(name)
                if target is None or target[0] not in owners:
                    continue
                tensor = handle.get_tensor(name)
                if tensor.numel() != 1:
                    raise ValueError(
                        f"{name}: a KV cache scale is one value per tensor; got shape {list(tensor.shape)}"
                    )
                value = float(tensor.float())
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"{name}: a KV cache scale must be finite and > 0; got {value}")
                layer, which = target
                for part in ("k", "v") if which == "kv" else (which,):
                    found.setdefault(layer, {})[part] = value
    scales = {
        layer: KVScales(parts.get("k", DEFAULT_KV_SCALE), parts.get("v", DEFAULT_KV_SCALE))
        for layer, parts in sorted(found.items())
    }
    if scales:
        logger.info("KV cache scales from the checkpoint for %d of %d KV-owning layers", len(scales), len(owners))
    return scales
