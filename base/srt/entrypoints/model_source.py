"""Resolve `--model NAME_OR_PATH` to something the loader can open, offline, or say what to do instead.

Looked at in this order:
1. a local checkpoint directory (must hold config.json);
2. a built-in preset name, when `--load-format dummy` asks for random weights;
3. a model name in the local Hugging Face cache (`google/gemma-4-E4B-it`, or `gemma-4-E4B-it` for short),
   found with huggingface_hub's cache lookup: nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from srt.configs import presets

# A bare published name is looked up under this organisation too.
DEFAULT_ORG = "google"


def resolve_model_path(model: str, load_format: str = "auto") -> str:
    """The checkpoint directory (or dummy preset name) that `model` names; ValueError explaining what was tried."""
    if not model:
        raise ValueError("model_path is empty: pass --model with a checkpoint directory, a cached name or a preset")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path.resolve()} has no config.json; is it a Hugging Face checkpoint?")
        return str(path.resolve())
    if presets.is_preset(model):
        if load_format == "dummy":
            return model
        cached = _from_hf_cache(model)
        if cached is not None:
            return cached
        raise ValueError(
            f"{model!r} is a built-in preset, but no checkpoint of it is in the local Hugging Face cache; "
            f"add --load-format dummy to serve it with random weights"
        )
    cached = _from_hf_cache(model)
    if cached is not None:
        return cached
    raise ValueError(
        f"cannot find model {model!r}. Looked for: a directory {path.resolve()} (does not exist); "
        f"{' and '.join(repr(c) for c in _candidates(model))} in the Hugging Face cache {_hf_cache_dir()} "
        f"(not there; downloads are never attempted); a built-in preset (known: {', '.join(presets.preset_names())}). "
        "Pass a checkpoint directory, download the model first (`hf download google/gemma-4-E4B-it`), "
        "or serve a preset with random weights (`--model tiny-gemma-4-E4B-it --load-format dummy`)."
    )


def _candidates(model: str) -> list[str]:
    return [model] if "/" in model else [model, f"{DEFAULT_ORG}/{model}"]


def _from_hf_cache(model: str) -> str | None:
    """The snapshot directory of a cached repo that has config.json, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # transformers depends on huggingface_hub, so this is only a safety net
        return None
    for repo_id in _candidates(model):
        try:
            found = try_to_load_from_cache(repo_id, "config.json")
        except ValueError:  # not a valid repo id (e.g. a path with too many slashes)
            continue
        if isinstance(found, str):
            return str(Path(found).parent)
    return None


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        return str(HF_HUB_CACHE)
    except ImportError:
        return "~/.cache/huggingface/hub"
