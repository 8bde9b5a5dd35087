"""Checkpoint loading: sharded and single-file safetensors, dtype casting, and one clear error per bad checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import CheckpointError, load_model

PRESET = "tiny-gemma-4-E4B-it"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_single_file_and_sharded_checkpoints_load_the_same_weights(tiny_checkpoint, tmp_path) -> None:
    from srt.tools.make_checkpoint import make_checkpoint

    single = tiny_checkpoint(PRESET)
    sharded = make_checkpoint(PRESET, tmp_path / "sharded", max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    config = ModelConfig.from_pretrained(single)
    a = load_model(config, single, "safetensors", torch.float32, torch.device("cpu")).state_dict()
    b = load_model(config, sharded, "safetensors", torch.float32, torch.device("cpu")).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_weights_are_cast_to_the_requested_dtype(tiny_checkpoint) -> None:
    path = tiny_checkpoint(PRESET)
    model = load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_projections_are_stored_transposed_with_the_checkpoint_values(tiny_checkpoint) -> None:
    path = tiny_checkpoint(PRESET)
    model = load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.float32, torch.device("cpu"))
    tensors = load_file(str(path / "model.safetensors"))
    layer, prefix = model.model.layers[0], "model.layers.0."
    stacked = {
        layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        layer.self_attn.o_proj: ["self_attn.o_proj"],
        layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
        layer.mlp.down_proj: ["mlp.down_proj"],
    }
    for linear, names in stacked.items():
        expected = torch.cat([tensors[f"{prefix}{name}.weight"] for name in names])
        assert torch.equal(linear.weight, expected), names
        assert linear.weight.stride() == (1, linear.weight.shape[0]), names  # a view of a row-major [in, out]
    shared = model.model.layers[-1].self_attn  # a KV-shared layer: q and o only
    assert shared.qkv_proj is None and shared.q_proj.weight.stride(0) == 1
    embedding = model.model.embed_tokens.weight  # the tied LM head
    assert torch.equal(embedding, tensors["model.embed_tokens.weight"]) and embedding.stride(0) == 1


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path) -> None:
    path = copy_checkpoint(tiny_checkpoint(PRESET), tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.3\.mlp\.up_proj\.weight"):
        load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.float32, torch.device("cpu"))


def test_wrong_shape_is_named(tiny_checkpoint, tmp_path) -> None:
    path = copy_checkpoint(tiny_checkpoint(PRESET), tmp_path / "ckpt")

    def shrink(tensors: dict) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()

    _edit_weights(path, shrink)
    with pytest.raises(CheckpointError, match=r"wrong shapes .*model\.norm\.weight: \(63,\) != \(64,\)"):
        load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.float32, torch.device("cpu"))


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path) -> None:
    path = copy_checkpoint(tiny_checkpoint(PRESET), tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.mystery\.weight"):
        load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.float32, torch.device("cpu"))


def test_unknown_model_type_is_rejected(tiny_checkpoint, tmp_path) -> None:
    path = copy_checkpoint(tiny_checkpoint(PRESET), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        ModelConfig.from_pretrained(path)


def test_not_a_gemma_model_type_at_all(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="no-such-model"):
        ModelConfig.from_pretrained(tmp_path)


def test_dummy_weights_are_seeded() -> None:
    config = ModelConfig.from_preset(PRESET)
    a = load_model(config, None, "dummy", torch.float32, torch.device("cpu"), seed=3).state_dict()
    b = load_model(config, None, "dummy", torch.float32, torch.device("cpu"), seed=3).state_dict()
    c = load_model(config, None, "dummy", torch.float32, torch.device("cpu"), seed=4).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_eos_ids_include_generation_config(tiny_checkpoint, tmp_path) -> None:
    from srt.model_executor.model_runner import checkpoint_eos_token_ids

    path = tiny_checkpoint(PRESET)
    config = ModelConfig.from_pretrained(path)
    # <eos> 1 and <turn|> 106 come from config.json; generation_config.json adds <tool_response|> 50
    assert checkpoint_eos_token_ids(config, str(path)) == [1, 50, 106]
    bare = copy_checkpoint(path, tmp_path / "ckpt")
    (bare / "generation_config.json").unlink()
    assert checkpoint_eos_token_ids(config, str(bare)) == [1, 106]
