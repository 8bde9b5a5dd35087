"""The full-vocabulary stand-in tokenizer of published presets served with `--load-format dummy`.

References: transformers' Gemma4Config for the published special-token ids, the tiny test tokenizer for how
text tokenizes, and the incremental detokenizer for what a stream shows per token.
"""

from __future__ import annotations

import random

import pytest
from transformers import Gemma4Config, Gemma4TextConfig

from srt.configs import presets
from srt.managers.detokenizer import IncrementalDetokenizer
from srt.managers.tokenizer_loader import TokenizersDecoder, load_decoder, load_tokenizer
from srt.server_args import ServerArgs
from srt.tools import standin_tokenizer, tokenizer_builder

VOCAB_SIZE = presets.preset_text_config("gemma-4-E4B-it").vocab_size
TEXT = "The quick brown fox met 3 friends at the station, then they took the 7:45 train."


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory):
    """A private cache directory for the whole module: the first load builds, later ones read the file."""
    with pytest.MonkeyPatch.context() as patch:
        home = tmp_path_factory.mktemp("xdg-cache")
        patch.setenv("XDG_CACHE_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def backend(cache_home):
    return standin_tokenizer.load_backend(VOCAB_SIZE)


def test_published_presets_have_a_full_vocabulary(backend) -> None:
    assert VOCAB_SIZE == 262144
    assert all(presets.preset_text_config(name).vocab_size == VOCAB_SIZE for name in presets.PUBLISHED)
    assert backend.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert sorted(backend.get_vocab(with_added_tokens=True).values()) == list(range(VOCAB_SIZE))


def test_special_tokens_sit_at_their_published_ids(backend) -> None:
    text, full = Gemma4TextConfig(), Gemma4Config()
    published = {
        "<pad>": text.pad_token_id,
        "<eos>": text.eos_token_id,
        "<bos>": text.bos_token_id,
        "<|image>": full.boi_token_id,
        "<|audio>": full.boa_token_id,
        "<|image|>": full.image_token_id,
        "<|audio|>": full.audio_token_id,
        "<image|>": full.eoi_token_id,
        "<audio|>": full.eoa_token_index,
        "<|video|>": full.video_token_id,
        "<|turn>": 105,
        "<turn|>": 106,
    }
    assert {token: backend.token_to_id(token) for token in published} == published
    ids = tokenizer_builder.published_special_token_ids()
    assert all(backend.id_to_token(token_id) == token for token, token_id in ids.items())
    turn = backend.encode("<|turn>user\nhi<turn|>", add_special_tokens=False).ids
    assert (turn[0], turn[-1]) == (105, 106)


def test_every_id_decodes_to_text_and_synthetic_ids_to_distinct_pieces(backend) -> None:
    texts = backend.decode_batch([[i] for i in range(VOCAB_SIZE)], skip_special_tokens=False)
    assert all(texts), [i for i, text in enumerate(texts) if not text][:5]
    special = set(tokenizer_builder.published_special_token_ids().values())
    synthetic = [i for i in range(presets.TINY_VOCAB_SIZE, VOCAB_SIZE) if i not in special]
    assert len({texts[i] for i in synthetic}) == len(synthetic)
    assert all(texts[i] == standin_tokenizer.synthetic_piece(i) for i in synthetic)
    assert texts[VOCAB_SIZE - 1] == " ~5m9r" and max(len(texts[i]) for i in synthetic) == 6
    assert int(texts[123456][2:], 36) == 123456  # a piece names its id


def test_text_tokenizes_as_with_the_tiny_tokenizer(backend) -> None:
    tiny = tokenizer_builder.build_backend_tokenizer(presets.TINY_VOCAB_SIZE)
    for text in (TEXT, "<|turn>user\nWhat is 2 + 2?<turn|>\n<|turn>model\n", "naïve café 你好"):
        ids = backend.encode(text).ids
        assert ids == tiny.encode(text).ids and max(ids) < presets.TINY_VOCAB_SIZE
        assert backend.decode(ids, skip_special_tokens=False) == tiny.decode(ids, skip_special_tokens=False)
    assert len(backend.encode(TEXT, add_special_tokens=False).ids) < len(TEXT) / 2  # BPE merges, not bytes


def test_cache_is_reused_and_rebuilt_for_a_new_version(cache_home, backend, monkeypatch) -> None:
    path = standin_tokenizer.cache_file(VOCAB_SIZE)
    assert path.parent == cache_home / "srt" / "tokenizers" and path.is_file()
    assert list(path.parent.glob("*.tmp")) == []

    def no_build(vocab_size: int):
        raise AssertionError("the cached tokenizer was rebuilt")

    monkeypatch.setattr(standin_tokenizer, "build_backend", no_build)
    again = standin_tokenizer.load_backend(VOCAB_SIZE)
    assert again.to_str() == backend.to_str()
    monkeypatch.setattr(standin_tokenizer, "VERSION", standin_tokenizer.VERSION + 1)
    with pytest.raises(AssertionError, match="rebuilt"):
        standin_tokenizer.load_backend(VOCAB_SIZE)


@pytest.mark.parametrize("preset", ["gemma-4-E4B-it", "gemma-4-26B-A4B-it"])
def test_server_tokenizer_applies_the_chat_template_of_the_tiny_twin(cache_home, preset) -> None:
    served = load_tokenizer(ServerArgs(model_path=preset, load_format="dummy"))
    twin = load_tokenizer(ServerArgs(model_path=f"tiny-{preset}", load_format="dummy"))
    assert len(served) == VOCAB_SIZE and len(twin) == presets.TINY_VOCAB_SIZE
    messages = [{"role": "user", "content": TEXT}]
    prompts = [t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for t in (served, twin)]
    assert prompts[0] == prompts[1] and prompts[0].startswith("<bos><|turn>user\n")
    assert served.encode(prompts[0], add_special_tokens=False) == twin.encode(prompts[1], add_special_tokens=False)
    assert (served.bos_token_id, served.eos_token_id, served.pad_token_id) == (2, 1, 0)


def test_detokenizer_decodes_as_the_server_tokenizer_and_streams_a_piece_per_token(cache_home) -> None:
    args = ServerArgs(model_path="gemma-4-E2B-it", load_format="dummy")
    decoder, reference = load_decoder(args), load_tokenizer(args)
    assert isinstance(decoder, TokenizersDecoder)
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB_SIZE) for _ in range(500)] + [1, 105, 258880, 7, 300, 1500]
    for skip in (True, False):
        assert decoder.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    # a random model's tokens: each step's delta is one non-empty piece, as a stream shows it
    detokenizer = IncrementalDetokenizer(decoder)
    sampled = [rng.randrange(presets.TINY_VOCAB_SIZE, 255_999) for _ in range(200)]
    deltas = [detokenizer.add([token]).text for token in sampled]
    assert deltas == [standin_tokenizer.synthetic_piece(token) for token in sampled]
