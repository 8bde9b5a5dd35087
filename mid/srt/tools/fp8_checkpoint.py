"""Write a tiny checkpoint's Linear weights in FP8 (compressed-tensors, as the published Gemma 4 FP8 checkpoints):
`make_checkpoint --quantize fp8-dynamic|fp8-block`. Embeddings, the per-layer-input table, the MoE router and
experts, norms and the (tied) LM head stay as they are, as in the published ones."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from srt.model_loader.fp8 import Fp8Scheme, quantize

# modules left in 16 bits although they are Linear: the router picks experts from small logit differences,
# the per-layer-input projection feeds a table of its own, the vision tower is not served in FP8
KEPT = ("re:.*router.*", "re:.*per_layer_model_projection.*", "re:.*vision.*", "re:.*embed_vision.*", "lm_head")


def quantize_checkpoint(out: Path, scheme_name: str, model: nn.Module) -> None:
    """Rewrite the checkpoint in `out` (saved from `model`) with its Linear weights in FP8 and a
    `quantization_config` in config.json."""
    scheme = Fp8Scheme.named(scheme_name, ignore=KEPT)
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    for file in sorted(out.glob("model*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if n.endswith(".weight")]:
            module = name.removesuffix(".weight")
            if module not in linears or scheme.keeps(module) or tensors[name].dim() != 2:
                continue
            tensors[name], tensors[f"{name}_scale"] = quantize(tensors[name], scheme)
            if index is not None:
                index["weight_map"][f"{name}_scale"] = file.name
        save_file(tensors, file, metadata={"format": "pt"})
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2) + "\n")
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = scheme.config()
    config_file.write_text(json.dumps(config, indent=2) + "\n")
