"""The tiny checkpoints load in transformers like published Gemma 4 checkpoints, and are deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma4ForCausalLM, GenerationConfig

from srt.configs import presets
from srt.tools.make_checkpoint import main, make_checkpoint, randomize_weights

TINY = [f"tiny-{name}" for name in presets.PUBLISHED]
LARGE = {"tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"}  # open the model turn with an empty thought channel

# Published Gemma 4 ids (all below the tiny vocab size).
SPECIAL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|tool_response>": 50, "<|think|>": 98}
SPECIAL_IDS |= {"<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106}

# Config fields that decide the model's structure; the saved config.json must keep them.
STRUCTURE_KEYS = (
    "layer_types", "num_kv_shared_layers", "attention_k_eq_v", "use_double_wide_mlp", "enable_moe_block",
    "num_experts", "top_k_experts", "hidden_size_per_layer_input", "final_logit_softcapping", "sliding_window",
    "rope_parameters", "tie_word_embeddings",
)  # fmt: skip

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing tab\t and\nnew lines\n\n",
    "Crème brûlée in Zürich costs 12.50 € — déjà vu!",
    "日本語のテキストと中文混合，还有한국어.",
    "Emoji: 👩‍👩‍👧 🚀🔥 ok",
    "def f(x):\n    return {'a': x ** 2}  # code",
    "Rare: ᚠᛇᚻ ∮ E⋅da = Q, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _weight_bytes(path: Path) -> dict[str, bytes]:
    return {shard.name: shard.read_bytes() for shard in sorted(path.glob("*.safetensors"))}


@pytest.mark.parametrize("preset", TINY)
def test_transformers_loads_model_config_and_tokenizer(tiny_checkpoint, preset):
    path = tiny_checkpoint(preset)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model) is Gemma4ForCausalLM and model.config.model_type == "gemma4_text"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == tokenizer.vocab_size == model.config.vocab_size == presets.TINY_VOCAB_SIZE
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_IDS} == SPECIAL_IDS
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    assert (model.config.pad_token_id, model.config.bos_token_id) == (0, 2)
    assert model.config.eos_token_id == [1, 106]
    generation = GenerationConfig.from_pretrained(path)
    assert (generation.bos_token_id, generation.pad_token_id, generation.eos_token_id) == (2, 0, [1, 106, 50])


@pytest.mark.parametrize("preset", TINY)
def test_saved_config_matches_preset(tiny_checkpoint, preset):
    saved, expected = AutoConfig.from_pretrained(tiny_checkpoint(preset)), presets.preset_text_config(preset)
    for key in STRUCTURE_KEYS:
        assert getattr(saved, key) == getattr(expected, key), key
    for layer in range(expected.num_hidden_layers):
        got, want = saved.per_layer_config[layer], expected.per_layer_config[layer]
        assert (got.head_dim, got.num_key_value_heads) == (want.head_dim, want.num_key_value_heads)


@pytest.mark.parametrize("preset", TINY)
def test_every_weight_is_randomized_and_saved(tiny_checkpoint, preset):
    path = tiny_checkpoint(preset)
    config = AutoConfig.from_pretrained(path)
    weights = _weights(path)
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        scalar = weights[prefix + "layer_scalar"]  # a buffer, but persistent: it must be in the file
        assert scalar.shape == (1,) and 0.5 <= scalar.item() <= 1.5 and scalar.item() != 1.0
        owns_kv = not (config.num_kv_shared_layers and layer >= first_shared)
        for name in ("k_proj.weight", "k_norm.weight"):
            assert (prefix + "self_attn." + name in weights) == owns_kv, (layer, name)
        if config.enable_moe_block:
            for name in ("router.scale", "router.per_expert_scale"):
                assert 0.5 <= weights[prefix + name].min() and weights[prefix + name].max() <= 1.5
                assert weights[prefix + name].std() > 0.1
            assert weights[prefix + "experts.gate_up_proj"].std() > 0.05
    norms = [name for name in weights if name.endswith("norm.weight")]
    assert norms and all(0.05 < (weights[name] - 1).std() < 0.2 for name in norms)
    assert "lm_head.weight" not in weights  # tied to the embeddings, like the published checkpoints

    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = {name: tensor for name, tensor in model.state_dict().items() if name in weights}
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)


@pytest.mark.parametrize("preset", TINY)
def test_forward_gives_well_separated_logits(tiny_checkpoint, preset):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(preset)).eval()
    generator = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, presets.TINY_VOCAB_SIZE, (4, 40), generator=generator)
    with torch.no_grad():
        logits = model(prompts).logits
    assert logits.shape == (4, 40, presets.TINY_VOCAB_SIZE) and torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert (gaps > 1e-3).float().mean() >= 0.97
    assert gaps.median() > 0.1
    # Different prompts must not collapse onto one distribution.
    assert logits[:, -1].argmax(-1).unique().numel() > 1


def test_tokenizer_round_trips_text_and_adds_bos(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("tiny-gemma-4-E4B-it"))
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 2 and 2 not in ids[1:], text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    # Control tokens in text become single ids; ordinary words are merged, not spelled byte by byte.
    assert tokenizer("<|turn>user\nhi<turn|>", add_special_tokens=False)["input_ids"][0] == 105
    assert tokenizer("<|turn>user\nhi<turn|>", add_special_tokens=False)["input_ids"][-1] == 106
    assert len(tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]) < len(TEXTS[0]) / 2


@pytest.mark.parametrize("preset", TINY)
def test_chat_template_renders_gemma4_turns(tiny_checkpoint, preset):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint(preset))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "<|channel>thought\nbe kind<channel|>Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Café? 你好 😊"}]},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = (
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi!<turn|>\n"
        "<|turn>model\nHello.<turn|>\n<|turn>user\nCafé? 你好 😊<turn|>\n<|turn>model\n"
    )
    assert prompt == expected + ("<|channel>thought\n<channel|>" if preset in LARGE else "")

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids.count(105) == 5 and ids.count(106) == 4

    thinking = tokenizer.apply_chat_template(
        messages[1:2], add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert thinking == "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi!<turn|>\n<|turn>model\n"
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("preset", TINY)
def test_sharded_checkpoint_loads_same_weights(tiny_checkpoint, tmp_path, preset):
    path = make_checkpoint(preset, tmp_path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = _weights(tiny_checkpoint(preset))
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in reference.items())


@pytest.mark.parametrize("preset", TINY)
def test_same_seed_gives_identical_bytes(tiny_checkpoint, tmp_path, preset):
    again = make_checkpoint(preset, tmp_path / "again", seed=0)
    assert _weight_bytes(again) == _weight_bytes(tiny_checkpoint(preset))
    assert (again / "tokenizer.json").read_bytes() == (tiny_checkpoint(preset) / "tokenizer.json").read_bytes()
    other = make_checkpoint(preset, tmp_path / "other", seed=1)
    assert _weight_bytes(other) != _weight_bytes(again)


def test_cli_writes_bfloat16_checkpoint(tiny_checkpoint, tmp_path, capsys):
    preset = "tiny-gemma-4-26B-A4B-it"
    main(["--preset", preset, "--out", str(tmp_path), "--dtype", "bfloat16", "--seed", "0"])
    assert "wrote" in capsys.readouterr().out
    weights, reference = _weights(tmp_path), _weights(tiny_checkpoint(preset))
    assert weights.keys() == reference.keys()
    assert all(weights[name].dtype == torch.bfloat16 for name in weights)
    assert all(torch.equal(weights[name], reference[name].to(torch.bfloat16)) for name in weights)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).dtype == torch.bfloat16


def test_rejects_published_presets_and_unknown_dtypes(tmp_path):
    with pytest.raises(ValueError, match="tiny"):
        make_checkpoint("gemma-4-E2B-it", tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        make_checkpoint("tiny-gemma-4-E2B-it", tmp_path, dtype="float8")


def test_rebuilding_over_a_sharded_checkpoint_leaves_no_stale_index(tmp_path):
    preset = "tiny-gemma-4-E2B-it"
    make_checkpoint(preset, tmp_path, max_shard_size="200KB")
    make_checkpoint(preset, tmp_path)
    assert sorted(path.name for path in tmp_path.glob("model*")) == ["model.safetensors"]


def test_randomize_weights_refuses_a_parameter_or_saved_buffer_it_does_not_know():
    model = Gemma4ForCausalLM(presets.preset_text_config("tiny-gemma-4-E2B-it"))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)  # not saved: needs no init
    randomize_weights(model, 0)
    model.model.register_buffer("extra_scale", torch.ones(2))  # saved with the weights
    with pytest.raises(RuntimeError, match="does not know how to initialise: model.extra_scale"):
        randomize_weights(model, 0)
    del model.model.extra_scale
    model.lm_head.extra = nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="does not know how to initialise: lm_head.extra$"):
        randomize_weights(model, 0)


def test_sharded_assistant_checkpoint_loads_same_weights(tiny_checkpoint, tmp_path):
    """An MTP assistant preset goes through the same save: sharded on request, stale shards of a whole-file
    build before it removed."""
    preset = "tiny-gemma-4-E4B-it-assistant"
    make_checkpoint(preset, tmp_path)  # a whole-file build first: its model.safetensors must not survive
    path = make_checkpoint(preset, tmp_path, max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(path)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in _weights(tiny_checkpoint(preset)).items())
