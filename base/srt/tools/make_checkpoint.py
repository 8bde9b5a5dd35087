"""Write a tiny, randomly initialised Gemma 4 checkpoint that transformers loads like a published one.

    python -m srt.tools.make_checkpoint --preset tiny-gemma-4-E4B-it --out /tmp/tiny-e4b [--seed 0]
        [--dtype float32|bfloat16] [--max-shard-size 200KB]
    python -m srt.tools.make_checkpoint --preset tiny-gemma-4-E4B-it-assistant --out /tmp/tiny-e4b-assistant
    python -m srt.tools.make_checkpoint --preset tiny-gemma-4-E4B-it --multimodal --out /tmp/tiny-e4b-mm

The directory holds config.json (`Gemma4TextConfig`, model_type `gemma4_text`), safetensors weights (sharded
with `model.safetensors.index.json` when `--max-shard-size` is small), generation_config.json and a byte-level
BPE tokenizer with Gemma 4's special tokens and chat template (see `tokenizer_builder`). An assistant preset
(`tiny-gemma-4-*-it-assistant`, the MTP drafter of the same tiny target) writes config.json
(`Gemma4AssistantConfig`, model_type `gemma4_assistant`) and its weights only: it uses the target's tokenizer.

Transformers' own init leaves norms at 1, `layer_scalar` at 1 and router scales at 1, which would let a
serving implementation that ignores any of them still match the reference. Every parameter and persistent
buffer is therefore re-drawn from a seeded generator, so the same preset and seed give byte-identical weights.

`--multimodal` writes the shape every published checkpoint has: `Gemma4ForConditionalGeneration` (config
`Gemma4Config`, model_type `gemma4`, a tiny vision tower with the preset's structure, no audio tower), plus the
image processor's files (`preprocessor_config.json`, `processor_config.json`), so transformers' image processor
and `AutoModelForImageTextToText` load it as they load a published one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, GenerationConfig
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4ClippableLinear,
    Gemma4RMSNorm,
    Gemma4TextDecoderLayer,
    Gemma4TextExperts,
    Gemma4TextRouter,
    Gemma4VisionModel,
    Gemma4VisionPatchEmbedder,
)
from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

from srt.configs import presets
from srt.model_loader.fp8 import SCHEMES
from srt.tools import tokenizer_builder
from srt.tools.fp8_checkpoint import quantize_checkpoint

# Standard deviations of the random init. The LM head is tied to the embeddings, so EMBED_STD sets the spread
# of the final logits: with hidden_size 64 they have std ~1.6 and the top-1/top-2 gap has a median of ~0.3
# (under 1e-3 for ~0.3% of positions). Attention, MLP and expert outputs are RMS-normalised before they reach
# the residual, so LINEAR_STD mainly sets how non-linear the GELU gates are.
EMBED_STD = 0.2
LINEAR_STD = 0.08
# Router scores are (normed hidden * scale / sqrt(hidden)) @ proj, std ~ROUTER_STD: wide enough that the
# k-th and (k+1)-th experts are ~0.3 apart (median) while every expert still gets traffic.
ROUTER_STD = 2.0
NORM_WEIGHT_STD = 0.1  # RMSNorm multiplies by `weight` directly: weight = 1 + N(0, 0.1)
SCALAR_RANGE = (0.5, 1.5)  # layer_scalar, router scale and per-expert scale: uniform, positive, around 1
# Clipping ranges of the vision tower's linears (E2B, E4B): narrow enough that some inputs and outputs clip, so a
# tower that ignores them fails the comparison.
CLIP_INPUT_RANGE = (1.5, 2.5)
CLIP_OUTPUT_RANGE = (0.4, 0.8)
STD_BIAS_STD = 1.0  # standardization of pooled soft tokens (26B-A4B, 31B): bias ~ the pooled values' spread

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_checkpoint(
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    multimodal: bool = False,
    quantize: str | None = None,
) -> Path:
    """Build the tiny checkpoint of `preset` in directory `out` (created if needed) and return its path;
    `multimodal`: a `Gemma4ForConditionalGeneration` with a vision tower and the image processor's files;
    `quantize`: "fp8-dynamic" or "fp8-block", the Linear weights in FP8 (compressed-tensors)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if presets.is_assistant_preset(preset):
        return make_assistant_checkpoint(preset, out, seed, dtype, max_shard_size)
    full_config = presets.preset_config(preset) if multimodal else None
    config = full_config.text_config if full_config is not None else presets.preset_text_config(preset)
    _require_tiny(preset, config.vocab_size)
    ids = tokenizer_builder.special_token_ids(config.vocab_size)
    config.pad_token_id, config.bos_token_id = ids[tokenizer_builder.PAD], ids[tokenizer_builder.BOS]
    end_of_text, end_of_turn = ids[tokenizer_builder.EOS], ids[tokenizer_builder.END_OF_TURN]
    # As in the published checkpoints: config.json stops at end of text or end of turn; generation also
    # stops where the model hands over to a tool (<|tool_response>).
    config.eos_token_id = [end_of_text, end_of_turn]

    torch.manual_seed(seed)
    if full_config is not None:
        full_config.pad_token_id, full_config.bos_token_id = config.pad_token_id, config.bos_token_id
        full_config.eos_token_id = config.eos_token_id
        model = Gemma4ForConditionalGeneration(full_config)
    else:
        model = Gemma4ForCausalLM(config)
    out = _save_random(model, out, seed, dtype, max_shard_size)
    if quantize is not None:
        quantize_checkpoint(out, quantize, model)
    if full_config is not None:
        _save_image_processor(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[end_of_text, end_of_turn, ids[tokenizer_builder.TOOL_RESPONSE]],
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    empty_thought_channel = tokenizer_builder.opens_empty_thought_channel(config)
    tokenizer = tokenizer_builder.build_tokenizer(config.vocab_size, empty_thought_channel)
    tokenizer.save_pretrained(out)
    return out


def make_assistant_checkpoint(
    preset: str, out: str | Path, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None
) -> Path:
    """Build the tiny MTP assistant checkpoint of `preset` (config.json and weights) in directory `out`."""
    config = presets.assistant_config(preset)
    _require_tiny(preset, config.text_config.vocab_size)
    torch.manual_seed(seed)
    return _save_random(Gemma4AssistantForCausalLM(config), out, seed, dtype, max_shard_size)


def _save_image_processor(out: Path) -> None:
    """The image processor's config (its defaults: 280 soft tokens per image, 16-pixel patches, 3x3 pooling) and
    the processor's, in the layout of the published checkpoints."""
    image_processor = Gemma4ImageProcessorPil()
    image_processor.save_pretrained(out)
    processor = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": image_processor.max_soft_tokens,
        "image_processor": image_processor.to_dict(),
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def _require_tiny(preset: str, vocab_size: int) -> None:
    if vocab_size != presets.TINY_VOCAB_SIZE:
        raise ValueError(f"{preset!r} is not a tiny preset; make_checkpoint only builds the tiny- presets")


def _save_random(model: nn.Module, out: str | Path, seed: int, dtype: str, max_shard_size: str | None) -> Path:
    """Draw `model`'s weights (`randomize_weights`), cast them to `dtype` and save them and its config in `out`."""
    model.eval()
    randomize_weights(model, seed)
    model.to(DTYPES[dtype])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Weights of an earlier build (say, sharded) would contradict these: save_pretrained keeps a stale index.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int) -> None:
    """Re-draw every parameter and persistent buffer of a Gemma 4 model or assistant from a generator seeded `seed`.

    Raises if any parameter or saved buffer is left untouched (a new transformers module would otherwise
    silently keep its default init).
    """
    generator = torch.Generator().manual_seed(seed)
    touched: set[int] = set()

    def normal_(tensor: torch.Tensor, std: float, mean: float = 0.0) -> None:
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * std + mean)
        touched.add(id(tensor))

    def uniform_(tensor: torch.Tensor, low: float, high: float) -> None:
        tensor.copy_(torch.rand(tensor.shape, generator=generator) * (high - low) + low)
        touched.add(id(tensor))

    # named_modules() walks in registration order, so the draw order (and the weights) are deterministic.
    for _, module in model.named_modules():
        if isinstance(module, Gemma4RMSNorm) and module.with_scale:
            normal_(module.weight, NORM_WEIGHT_STD, mean=1.0)
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, EMBED_STD)
        elif isinstance(module, nn.Linear) and id(module.weight) not in touched:  # lm_head is tied
            normal_(module.weight, LINEAR_STD)
            if module.bias is not None:
                normal_(module.bias, LINEAR_STD)
        elif isinstance(module, Gemma4TextRouter):
            normal_(module.proj.weight, ROUTER_STD)
            uniform_(module.scale, *SCALAR_RANGE)
            uniform_(module.per_expert_scale, *SCALAR_RANGE)
        elif isinstance(module, Gemma4TextExperts):
            normal_(module.gate_up_proj, LINEAR_STD)
            normal_(module.down_proj, LINEAR_STD)
        elif isinstance(module, Gemma4TextDecoderLayer):
            uniform_(module.layer_scalar, *SCALAR_RANGE)
        elif isinstance(module, Gemma4ClippableLinear) and module.use_clipped_linears:
            uniform_(module.input_max, *CLIP_INPUT_RANGE)
            uniform_(module.input_min, -CLIP_INPUT_RANGE[1], -CLIP_INPUT_RANGE[0])
            uniform_(module.output_max, *CLIP_OUTPUT_RANGE)
            uniform_(module.output_min, -CLIP_OUTPUT_RANGE[1], -CLIP_OUTPUT_RANGE[0])
        elif isinstance(module, Gemma4VisionPatchEmbedder):
            normal_(module.position_embedding_table, EMBED_STD)
        elif isinstance(module, Gemma4VisionModel) and module.config.standardize:
            normal_(module.std_bias, STD_BIAS_STD)
            uniform_(module.std_scale, *SCALAR_RANGE)
        elif isinstance(module, Gemma4AssistantMaskedEmbedder):
            # which vocabulary ids make up each centroid's cluster: a seeded permutation, as trained ones are
            module.token_ordering.copy_(torch.randperm(module.vocab_size, generator=generator))
            touched.add(id(module.token_ordering))

    saved = dict(model.named_parameters())
    saved.update({name: buf for name, buf in model.named_buffers() if _is_persistent(model, name)})
    missed = sorted(name for name, tensor in saved.items() if id(tensor) not in touched)
    if missed:
        raise RuntimeError(f"randomize_weights does not know how to initialise: {', '.join(missed)}")


def _is_persistent(model: nn.Module, buffer_name: str) -> bool:
    owner_name, _, leaf = buffer_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return leaf not in owner._non_persistent_buffers_set


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [*presets.preset_names(), *presets.assistant_preset_names()]
    tiny = [name for name in names if name.startswith("tiny-")]
    parser.add_argument("--preset", required=True, choices=tiny)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", default=None, help="e.g. 200KB; shards the safetensors weights")
    parser.add_argument(
        "--multimodal", action="store_true", help="Gemma4ForConditionalGeneration with a vision tower (as published)"
    )
    parser.add_argument(
        "--quantize", choices=SCHEMES, help="Linear weights in FP8 (compressed-tensors): per-channel or 128x128 blocks"
    )
    args = parser.parse_args(argv)
    path = make_checkpoint(
        args.preset, args.out, args.seed, args.dtype, args.max_shard_size, args.multimodal, args.quantize
    )
    print(f"wrote {args.preset} (seed {args.seed}, {args.dtype}) to {path}")


if __name__ == "__main__":
    main()
