"""Incremental detokenizing and stop strings, on the tiny model's byte-level BPE tokenizer."""

import pytest

from proxy.templates import Conversation
from proxy.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopChecker


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ModelTokenizer.from_dir(tiny_model_dir, template_timeout_s=1.0)


@pytest.mark.parametrize("text", ["plain ascii text", "héllo wörld", "你好，世界", "emoji 🚀🎉 end", "mixé 🚀 中文 x"])
def test_streamed_text_equals_full_decode_and_never_shows_a_split_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([token_id]) for token_id in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # a 4-byte character the tiny vocabulary splits
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert "".join(detok.add([i]) for i in ids[1:]) == "🚀"


def test_stop_string_split_across_pieces_is_found_and_cut():
    checker = StopChecker(["STOP"])
    out = checker.feed("hello ST") + checker.feed("O") + checker.feed("P and more")
    assert out == "hello " and checker.is_stopped


def test_text_that_only_looks_like_a_stop_start_is_released():
    checker = StopChecker(["STOP"])
    out = checker.feed("a ST") + checker.feed("ART") + checker.flush()
    assert out == "a START" and not checker.is_stopped


def test_earliest_of_several_stop_strings_wins():
    checker = StopChecker(["xyz", "b"])
    assert checker.feed("aaxyzb") == "aa" and checker.is_stopped


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.render_chat(Conversation([{"role": "user", "content": "hi"}]))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == "user\nhi\nassistant\n"  # special tokens are skipped when decoding
