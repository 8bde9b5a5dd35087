"""Incremental detokenization: streamed pieces add up to the tokenizer's own decode, never show half a
character, and stop strings cut the text (and the tokens) at their first occurrence."""

from __future__ import annotations

import pytest

from srt.managers.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from srt.tools.tokenizer_builder import build_tokenizer

TEXT = "Grüße, 你好世界 🙂 naïve café — ok. The end, the END."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(1024)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = []
    for start in range(0, len(ids), chunk):
        new = ids[start : start + chunk]
        pieces.append(detok.add(new, finished=start + chunk >= len(ids)).text)
    return pieces


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_pieces_add_up_and_never_split_a_character(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # the test only means something if single tokens really hold partial characters
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    pieces = stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    assert "".join(pieces) == TEXT == tokenizer.decode(ids)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = [2, *tokenizer.encode("hi there", add_special_tokens=False), 106]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "hi there"
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) == "<bos>hi there<turn|>"


def test_invalid_bytes_at_the_end_are_flushed(tokenizer):
    ids = tokenizer.encode("ab 你", add_special_tokens=False)
    cut = ids[:-1]  # ends inside the 3-byte character
    assert tokenizer.decode(cut).endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(tokenizer)
    held = "".join(detok.add([t]).text for t in cut)
    assert not held.endswith(REPLACEMENT_CHAR)
    assert held + detok.add([], finished=True).text == tokenizer.decode(cut)


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_cuts_text_and_tokens(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "the"  # only in "the END": stop strings are case-sensitive, "The" does not match
    detok = IncrementalDetokenizer(tokenizer, stop=["zzz", stop])
    pieces, used, matched = [], 0, None
    for start in range(0, len(ids), chunk):
        result = detok.add(ids[start : start + chunk])
        pieces.append(result.text)
        used += result.num_tokens
        if result.stop_matched:
            matched = result.stop_matched
            break
    expected = TEXT[: TEXT.index(stop)]
    assert matched == stop and "".join(pieces) == expected
    # the tokens kept are exactly those up to the one that completed the stop string
    assert stop in tokenizer.decode(ids[:used]) and stop not in tokenizer.decode(ids[: used - 1])
    assert detok.add(ids[used:], finished=True).text == ""  # nothing after a stop


def test_possible_stop_prefix_is_held_back_until_it_diverges(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["end."])
    ids = tokenizer.encode("the end, the end.", add_special_tokens=False)  # t|he| end|,| the| end|.
    shown = [detok.add([token]).text for token in ids[:3]]
    assert "".join(shown) == "the "  # " end" may begin "end.": held back
    assert detok.add([ids[3]]).text == "end,"  # "," rules it out: released
    rest = [detok.add([token]) for token in ids[4:]]
    assert "".join(r.text for r in rest) == " the "
    assert rest[-1].stop_matched == "end." and rest[-1].num_tokens == 1


def test_stop_string_completed_by_the_flush(tokenizer):
    ids = tokenizer.encode("say 你", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["你"])
    text = "".join(detok.add([t], finished=i == len(ids) - 1).text for i, t in enumerate(ids))
    assert text == "say " and detok.stopped == "你"


def test_detokenizer_process_decodes_as_transformers(tokenizer, tmp_path):
    """The detokenizer process decodes with `tokenizers` directly; it must agree with transformers."""
    from transformers import AutoTokenizer

    from srt.managers.tokenizer_loader import TokenizersDecoder, load_decoder
    from srt.server_args import ServerArgs

    tokenizer.save_pretrained(tmp_path)
    decoder = load_decoder(ServerArgs(model_path=str(tmp_path)))
    assert isinstance(decoder, TokenizersDecoder)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    ids = list(range(1024)) + tokenizer.encode(TEXT)
    for skip in (True, False):
        for start in range(0, len(ids), 37):
            window = ids[start : start + 53]
            want = reference.decode(window, skip_special_tokens=skip)
            assert decoder.decode(window, skip_special_tokens=skip) == want
