"""Build a Gemma 4 model on a device and fill its weights.

The model is built on the meta device and materialised once on the target device in the target dtype, so
loading never holds two copies of the weights. An FP8 checkpoint's decoder projections are materialised as
`Fp8Linear`s and keep their FP8 weights and scales (`fp8_model.use_fp8_projections`; `dequantize_fp8=True`:
every FP8 weight dequantized into the model's dtype instead, the 16-bit reference). `quantization="fp8"`
quantizes the loaded model's projections per output channel (`fp8_model.quantize_model_fp8`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from srt.configs.model_config import ModelConfig
from srt.distributed.weight_shards import Shard, read_shard, shard_of, shard_row_scale
from srt.layers.fp8_linear import Fp8Linear
from srt.model_loader.fp8 import FP8, Fp8Scheme, dequantize, scheme_of_checkpoint
from srt.model_loader.fp8_model import QUANTIZATIONS, quantize_model_fp8, use_fp8_projections
from srt.model_loader.kv_scales import kv_scale_target
from srt.model_loader.weight_names import AUDIO_PREFIXES, to_param_name
from srt.models.gemma4 import Gemma4ForCausalLM
from srt.models.gemma4_mm import Gemma4ForConditionalGeneration

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory: the shards of the index, or `model.safetensors`."""
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"no safetensors weights in {path} (looked for model.safetensors[.index.json])")


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    fp8_params: set[str] = frozenset(),
    scheme: Fp8Scheme | None = None,
) -> Gemma4ForCausalLM:
    """An uninitialised model with every parameter allocated on `device` in `dtype`; the decoder projections
    named in `fp8_params` (`NAME.weight`) as Fp8Linears of `scheme` (FP8 weight, float32 scale)."""
    model_class = Gemma4ForConditionalGeneration if config.vision_config is not None else Gemma4ForCausalLM
    with torch.device("meta"):
        model = model_class(config)
    model = model.to(dtype=dtype)  # before the FP8 modules join: `to` would cast them too
    if fp8_params:
        use_fp8_projections(model, fp8_params, scheme)
    return model.to_empty(device=device).eval()


def fp8_checkpoint_params(config: ModelConfig, model_path: str | Path) -> set[str]:
    """Parameter names whose checkpoint tensor is float8 (read from the safetensors headers only)."""
    names = set()
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for checkpoint_name in handle.keys():
                if handle.get_slice(checkpoint_name).get_dtype() == "F8_E4M3":
                    name = to_param_name(checkpoint_name, config)
                    if name is not None:
                        names.add(name)
    return names


def load_model(
    config: ModelConfig,
    model_path: str | Path | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantization: str | None = None,
    dequantize_fp8: bool = False,
) -> Gemma4ForCausalLM:
    """The model with weights from `model_path` (safetensors) or seeded random values (`dummy`). An FP8
    checkpoint's projections stay FP8 unless `dequantize_fp8`; `quantization="fp8"` quantizes the rest of the
    projections (all of them for a 16-bit checkpoint) per output channel after loading."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if load_format == "dummy":
        model = build_model(config, dtype, device)
        fill_dummy_weights(model, seed)
    else:
        if model_path is None:
            raise ValueError("a checkpoint directory is needed unless load_format is 'dummy'")
        scheme = scheme_of_checkpoint(model_path)
        fp8_params = set() if scheme is None or dequantize_fp8 else fp8_checkpoint_params(config, model_path)
        model = build_model(config, dtype, device, fp8_params, scheme)
        load_safetensors(model, config, model_path)
    model.fuse_projections()
    if quantization == "fp8":
        quantize_model_fp8(model)
    return model


@torch.no_grad()
def load_safetensors(model: Gemma4ForCausalLM, config: ModelConfig, model_path: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter; raise one CheckpointError naming every problem."""
    state = model.state_dict()
    loaded: set[str] = set()
    unexpected, mis_shaped = [], []
    audio = 0
    scheme = scheme_of_checkpoint(model_path)
    fp8_weights: dict[str, torch.Tensor] = {}  # dequantized once every shard is read (scales may come later)
    fp8_shards: dict[str, tuple[Shard | None, int]] = {}  # (this rank's shard, the whole N) of each FP8 weight
    fp8_scales: dict[str, torch.Tensor] = {}
    kept = 0
    files = safetensors_files(model_path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None) as progress:
        for handle in handles:
            for checkpoint_name in handle.keys():
                progress.update(1)
                if checkpoint_name.endswith(".weight_scale"):
                    fp8_scales[checkpoint_name.removesuffix("_scale")] = handle.get_tensor(checkpoint_name)
                    continue
                if kv_scale_target(checkpoint_name) is not None:
                    continue  # KV cache scales are the pool's (kv_scales.py), read only for an FP8 KV cache
                audio += checkpoint_name.startswith(AUDIO_PREFIXES)
                name = to_param_name(checkpoint_name, config)
                if name is None:
                    continue
                if name not in state:
                    unexpected.append(checkpoint_name)
                    continue
                shard = None
                if config.tp_size > 1:  # this rank's part only, read from the file as such
                    piece = handle.get_slice(checkpoint_name)
                    shard = shard_of(name, piece.get_shape(), config)
                    tensor = read_shard(piece, shard)
                else:
                    tensor = handle.get_tensor(checkpoint_name)
                if tensor.dtype == FP8:
                    fp8_weights[checkpoint_name] = tensor
                    fp8_shards[checkpoint_name] = (shard, piece.get_shape()[0] if shard is not None else 0)
                    continue
                if tuple(tensor.shape) != tuple(state[name].shape):
                    mis_shaped.append(f"{checkpoint_name}: {tuple(tensor.shape)} != {tuple(state[name].shape)}")
                    continue
                state[name].copy_(tensor)
                loaded.add(name)
    for checkpoint_name, q in fp8_weights.items():
        name = to_param_name(checkpoint_name, config)
        scale = fp8_scales.pop(checkpoint_name, None)
        if scheme is None or scale is None:
            what = "no quantization_config in config.json" if scheme is None else "no weight_scale beside it"
            unexpected.append(f"{checkpoint_name} (float8, {what})")
        elif tuple(q.shape) != tuple(state[name].shape):
            mis_shaped.append(f"{checkpoint_name}: {tuple(q.shape)} != {tuple(state[name].shape)}")
        elif f"{name}_scale" in state:  # an Fp8Linear: the weight as it is, the scale in its row form
            module = model.get_submodule(name.removesuffix(".weight"))
            assert isinstance(module, Fp8Linear)
            shard, whole_rows = fp8_shards[checkpoint_name]
            if shard is None:
                row_scale = module.scale_from_checkpoint(scale)
            else:
                row_scale = shard_row_scale(scale, shard, whole_rows, module.block)
            if tuple(row_scale.shape) != tuple(state[f"{name}_scale"].shape):
                mis_shaped.append(f"{checkpoint_name}_scale: {tuple(scale.shape)} (scales of {module.extra_repr()})")
                continue
            state[name].copy_(q)
            state[f"{name}_scale"].copy_(row_scale)
            loaded.update((name, f"{name}_scale"))
            kept += 1
        elif fp8_shards[checkpoint_name][0] is not None:
            raise ValueError(f"{checkpoint_name}: tensor-parallel ranks keep their shards of FP8 projections in FP8")
        else:
            state[name].copy_(dequantize(q, scale, scheme, state[name].dtype))
            loaded.add(name)
    unexpected += [f"{name}_scale (no float8 weight)" for name in fp8_scales]
    if fp8_weights and scheme is not None:
        logger.info(
            "FP8 weights (%s) of %s: %d kept in FP8, %d dequantized",
            scheme.strategy, model_path, kept, len(fp8_weights) - kept,
        )  # fmt: skip
    if audio:
        logger.info("skipped %d audio tensors of %s: srt does not serve audio input yet", audio, model_path)
    missing = sorted(set(state) - loaded)
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if mis_shaped:
        problems.append(f"wrong shapes (checkpoint != model): {'; '.join(mis_shaped)}")
    if problems:
        raise CheckpointError(f"checkpoint {model_path} does not match the model: " + " | ".join(problems))


@torch.no_grad()
def fill_dummy_weights(model: Gemma4ForCausalLM, seed: int) -> None:
    """Seeded random weights at the real shapes (for benchmarks: a forward costs the same for any values).

    Norm weights, scales and layer scalars are 1 so activations keep a sane range through deep stacks. Each
    tensor draws from its own seed (`seed` + its index), so that tensor-parallel ranks agree on the tensors
    they all hold whole (the router, norms) whatever the shapes of their shards.
    """
    generator = torch.Generator(device=next(model.parameters()).device)
    items = list(model.state_dict().items())
    for index, (name, tensor) in enumerate(tqdm(items, desc="Dummy weights", unit="tensor", disable=None)):
        generator.manual_seed(seed + index)
        if name.endswith(("_min", "_max")):  # clipping ranges of the vision tower's linears: clip nothing
            tensor.fill_(float("-inf") if name.endswith("_min") else float("inf"))
        elif "norm" in name or name.endswith(("layer_scalar", "scale")):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
