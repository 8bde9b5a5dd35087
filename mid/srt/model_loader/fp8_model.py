"""FP8 across a whole model (#26): which projections an FP8 checkpoint keeps in FP8, and `--quantization fp8`.

- `use_fp8_projections`: before the weights are allocated, the decoder projections (q/k/v/o, gate/up/down) whose
  checkpoint weight is float8 become `Fp8Linear`s, so loading copies the FP8 weight and its scale as they are
  (`loader.load_safetensors`). Other quantized Linears of a checkpoint (the per-layer-input gate and
  projection: small GEMVs with kernels of their own) are dequantized into the model's dtype at load.
- `quantize_model_fp8`: the post-load hook of `--quantization fp8`. It calls `quantize_fp8()` on every module
  that defines one: the decoder's attention and MLP (their projections quantized per output channel) and any
  other module that learns to (MoE experts); embeddings, the per-layer-input table and its projection, the
  router, norms and the LM head stay in 16 bits.
- `emulate_fp8_activations`: the CPU reference's W8A8 numerics (activations quantized as on the GPU's
  prefill path), for tests that bound the error against 16 bits.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from srt.layers.fp8_linear import Fp8Linear
from srt.model_loader.fp8 import Fp8Scheme
from srt.models.gemma4_layers import Gemma4Attention, Gemma4MLP

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
PROJECTIONS = {
    Gemma4Attention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    Gemma4MLP: ("gate_proj", "up_proj", "down_proj"),
}


def use_fp8_projections(model: nn.Module, fp8_params: set[str], scheme: Fp8Scheme) -> int:
    """Turn the decoder projections whose `NAME.weight` is in `fp8_params` into empty Fp8Linears on the meta
    device (call before the model is materialised); returns how many."""
    block = scheme.block if scheme.strategy == "block" else None
    count = 0
    for prefix, module in model.named_modules():
        for attr in PROJECTIONS.get(type(module), ()):
            linear = getattr(module, attr, None)
            if isinstance(linear, nn.Linear) and f"{prefix}.{attr}.weight" in fp8_params:
                setattr(module, attr, Fp8Linear(linear.in_features, linear.out_features, block, device="meta"))
                count += 1
    return count


@torch.no_grad()
def quantize_model_fp8(model: nn.Module) -> int:
    """`--quantization fp8` after loading (and `fuse_projections`): `quantize_fp8()` on every module that has it.
    Returns how many modules were quantized."""
    targets = [module for module in model.modules() if callable(getattr(module, "quantize_fp8", None))]
    for module in targets:
        module.quantize_fp8()
    fp8_bytes = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit weights' memory back to the device, for the KV pools
    logger.info("quantized %d modules to FP8 (%.2f GiB of FP8 projection weights)", len(targets), fp8_bytes / 2**30)
    return len(targets)


def emulate_fp8_activations(model: nn.Module, enabled: bool = True) -> None:
    """Quantize the activations of every Fp8Linear in the reference path (see `layers/fp8_linear.py`)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.emulate_activations = enabled
