"""FP8 weights in the compressed-tensors format, as the published Gemma 4 FP8 checkpoints store them (#26).

A quantized Linear's checkpoint holds `weight` in float8_e4m3fn and `weight_scale` beside it:

    fp8-dynamic   strategy "channel"   weight_scale [out, 1]                 w = q * scale (per output row)
    fp8-block     strategy "block"     weight_scale [ceil(out/128), ceil(in/128)]   w = q * scale of its tile

Activations are quantized per token ("channel" checkpoints) or per 128-group ("block") at run time, so the
checkpoint holds no activation scale. `config.json`'s `quantization_config` names the scheme and the modules
left in 16 bits (`ignore`: names or `re:` patterns). This module reads that config, and quantizes and
dequantizes weights. Loading keeps the decoder projections' FP8 weights as `Fp8Linear`s (`fp8_model.py`,
`layers/fp8_linear.py`) and dequantizes the other FP8 weights into the model's dtype (all of them with
`dequantize_fp8`, the 16-bit reference).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCHEMES = ("fp8-dynamic", "fp8-block")
BLOCK = 128


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's Linear weights are quantized."""

    strategy: str  # "channel" or "block"
    block: tuple[int, int] = (BLOCK, BLOCK)
    ignore: tuple[str, ...] = ()  # module names or "re:" patterns kept in 16 bits

    @classmethod
    def named(cls, name: str, ignore: tuple[str, ...] = ()) -> Fp8Scheme:
        if name not in SCHEMES:
            raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}; got {name!r}")
        return cls("channel" if name == "fp8-dynamic" else "block", ignore=ignore)

    def keeps(self, module: str) -> bool:
        """Whether `module` (a checkpoint module name) stays in 16 bits."""
        for pattern in self.ignore:
            if pattern.startswith("re:") and re.fullmatch(pattern[3:], module):
                return True
            if module == pattern:
                return True
        return False

    def config(self) -> dict:
        """The `quantization_config` of a checkpoint in this scheme (compressed-tensors' layout)."""
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": self.strategy}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        if self.strategy == "block":
            weights["block_structure"] = list(self.block)
            activations.update(strategy="group", group_size=self.block[1])
        group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(self.ignore),
        }


def scheme_of_checkpoint(model_path: str | Path) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint directory's config.json; None when it is not quantized. Raises ValueError
    naming what is not supported (other methods, bit widths, static activation scales, several groups)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    quant = json.loads(config_file.read_text()).get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"quantization method {method!r} is not supported; srt loads compressed-tensors FP8")
    groups = list(quant.get("config_groups", {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (one FP8 group)")
    weights, activations = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ValueError(f"only 8-bit float weights are supported; got {weights}")
    if activations and not activations.get("dynamic", False):
        raise ValueError("static activation scales are not supported; srt quantizes activations dynamically")
    strategy = weights.get("strategy")
    if strategy == "channel":
        return Fp8Scheme("channel", ignore=tuple(quant.get("ignore", ())))
    if strategy == "block":
        block = tuple(weights.get("block_structure") or (BLOCK, BLOCK))
        return Fp8Scheme("block", block=block, ignore=tuple(quant.get("ignore", ())))
    raise ValueError(f"FP8 weight strategy {strategy!r} is not supported (channel, block)")


def quantize(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) of a [out, in] weight: absmax / 448 per row or per tile."""
    w = weight.float()
    if scheme.strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    tiles = _tiles(w, scheme.block)  # [rows of tiles, cols of tiles, bo, bi]
    scale = (tiles.abs().amax(dim=(2, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / _expand(scale, scheme.block, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, dtype: torch.dtype) -> torch.Tensor:
    """The weight `q * scale` in `dtype` (the scale broadcast per row, or over each tile)."""
    if scheme.strategy == "channel":
        return (q.float() * scale.float().reshape(-1, 1)).to(dtype)
    return (q.float() * _expand(scale.float(), scheme.block, q.shape)).to(dtype)


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out, inp = w.shape
    bo, bi = block
    padded = torch.zeros(-(-out // bo) * bo, -(-inp // bi) * bi, dtype=w.dtype, device=w.device)
    padded[:out, :inp] = w
    return padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).transpose(1, 2)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A per-tile scale [tiles_out, tiles_in] repeated to the weight's [out, in]."""
    bo, bi = block
    return scale.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)[: shape[0], : shape[1]]
