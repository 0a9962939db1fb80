"""Incremental detokenizing, stop strings over tokens and logprob token text, on the proxy
tests' own byte-level BPE tokenizer (no weights, no torch)."""

from __future__ import annotations

import pytest

from engine import protocol
from proxy.choices import ChoiceState
from proxy.tokenizer import IncrementalDetokenizer, ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


def _tokens(ids: list[int]) -> list[protocol.TokenLogprob]:
    return [protocol.TokenLogprob(i, -1.0, []) for i in ids]


@pytest.mark.parametrize("text", ["caf\u00e9 na\u00efve", "\u4f60\u597d\uff0c\u4e16\u754c", "a \U0001f680\U0001f389 b",
                                  "\u00e9\U0001f680\u4e2d"])
def test_one_token_at_a_time_never_emits_a_partial_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


def test_four_byte_character_appears_only_with_its_last_byte(tokenizer):
    ids = tokenizer.encode("\U0001f680")
    assert len(ids) == 4
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add([i]) for i in ids] == ["", "", "", "\U0001f680"]


def test_a_truly_broken_character_shows_at_the_end_only(tokenizer):
    first_byte = tokenizer.encode("\U0001f680")[0]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(tokenizer.encode("ok") + [first_byte]) == "ok"
    assert detokenizer.flush() == "\ufffd"


def test_stop_string_across_tokens_cuts_text_and_finishes_with_stop(tokenizer):
    state = ChoiceState(0, tokenizer, ["re! Ho"])
    deltas = [state.add(_tokens([i]), None) for i in tokenizer.encode("hello there! How are you")]
    finished = [d for d in deltas if d.finish_reason is not None]
    assert state.text == "hello the" and finished[0].finish_reason == "stop"


def test_stop_string_at_the_very_end_is_cut_on_the_last_token(tokenizer):
    state = ChoiceState(0, tokenizer, ["you"])
    ids = tokenizer.encode("how are you")
    state.add(_tokens(ids[:-1]), None)
    delta = state.add(_tokens(ids[-1:]), "length")
    assert (state.text, delta.finish_reason) == ("how are ", "stop")


def test_held_back_text_is_released_when_the_request_ends(tokenizer):
    state = ChoiceState(0, tokenizer, ["xyz"])
    state.add(_tokens(tokenizer.encode("abc x")), None)
    assert state.text == "abc"
    state.add(_tokens(tokenizer.encode("y")), "length")
    assert (state.text, state.finish_reason) == ("abc xy", "length")


def test_partial_byte_tokens_have_distinct_logprob_texts_and_real_bytes(tokenizer):
    ids = tokenizer.encode("\U0001f680")
    texts = [tokenizer.token_text(i) for i in ids]
    assert texts == ["bytes:\\xf0", "bytes:\\x9f", "bytes:\\x9a", "bytes:\\x80"]
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == "\U0001f680".encode()


def test_legacy_text_offsets_count_whole_characters(tokenizer):
    ids = tokenizer.encode("\u00e9\U0001f680a")
    state = ChoiceState(0, tokenizer, [], wants_logprobs=True)
    logprobs = state.completion_logprobs(_tokens(ids))
    assert logprobs["text_offset"][-1] == 2  # "a" follows two characters
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_chat_template_uses_bos_and_generation_prompt(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    text = tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer.eos_token_ids) == 2
