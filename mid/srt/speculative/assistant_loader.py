"""Build the MTP assistant beside its target and fill its weights (checkpoint or seeded dummy values)."""

from __future__ import annotations

from pathlib import Path

import torch

from srt.configs.assistant_config import AssistantConfig, load_assistant_hf_config
from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import LOAD_FORMATS, load_safetensors
from srt.models.gemma4_assistant import Gemma4AssistantForCausalLM


def load_assistant(
    draft_model_path: str,
    target: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Gemma4AssistantForCausalLM:
    """The assistant of `draft_model_path` (a directory, or an assistant preset with `dummy`), checked to fit
    `target` (the whole target, not a rank's shard) first: a mismatched pair fails here, with one ValueError,
    before any weight is read. Under tensor parallelism, rank `tp_rank`'s shard of it."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    config = AssistantConfig.for_target(load_assistant_hf_config(draft_model_path), target, draft_model_path)
    if tp_size > 1:
        config = config.for_tensor_parallel(tp_rank, tp_size)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device).eval()
    if load_format == "dummy":
        fill_dummy_assistant(model, seed)
    else:
        # the assistant's layers own no K/V, so k/v weights some exports keep are skipped by the name mapping
        load_safetensors(model, config.text, Path(draft_model_path))
    model.fuse_projections()
    return model


@torch.no_grad()
def fill_dummy_assistant(model: Gemma4AssistantForCausalLM, seed: int) -> None:
    """Seeded random weights at the real shapes; norms and scalars 1, the centroid token order a permutation.
    Each tensor draws from its own seed, so tensor-parallel ranks agree on the tensors they hold whole."""
    generator = torch.Generator(device=next(model.parameters()).device)
    for index, (name, tensor) in enumerate(model.state_dict().items()):
        generator.manual_seed(seed + index)
        if name.endswith("token_ordering"):
            tensor.copy_(torch.randperm(len(tensor), generator=generator, device=tensor.device))
        elif "norm" in name or name.endswith("layer_scalar"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
