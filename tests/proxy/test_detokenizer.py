"""Incremental detokenizing, stop strings over tokens and logprob token text, on the proxy
tests' own byte-level BPE and Llama-style byte-fallback tokenizers (no weights, no torch); and
why tokenizers' DecodeStream does not replace IncrementalDetokenizer."""

from __future__ import annotations

import pytest
from tokenizers.decoders import DecodeStream

from engine import protocol
from proxy.choices import ChoiceState
from proxy.templates import Conversation
from proxy.tokenizer import IncrementalDetokenizer, ModelTokenizer, TextOptions


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir, template_timeout_s=1.0)


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
    state = ChoiceState(0, tokenizer, TextOptions(["re! Ho"]))
    deltas = [state.add(_tokens([i]), None) for i in tokenizer.encode("hello there! How are you")]
    finished = [d for d in deltas if d.finish_reason is not None]
    assert state.text == "hello the" and finished[0].finish_reason == "stop"


def test_stop_string_at_the_very_end_is_cut_on_the_last_token(tokenizer):
    state = ChoiceState(0, tokenizer, TextOptions(["you"]))
    ids = tokenizer.encode("how are you")
    state.add(_tokens(ids[:-1]), None)
    delta = state.add(_tokens(ids[-1:]), "length")
    assert (state.text, delta.finish_reason) == ("how are ", "stop")


def test_held_back_text_is_released_when_the_request_ends(tokenizer):
    state = ChoiceState(0, tokenizer, TextOptions(["xyz"]))
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
    state = ChoiceState(0, tokenizer, TextOptions([]), wants_logprobs=True)
    logprobs = state.completion_logprobs(_tokens(ids))
    assert logprobs["text_offset"][-1] == 2  # "a" follows two characters
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_chat_template_uses_bos_and_generation_prompt(tokenizer):
    text = tokenizer.render_chat(Conversation([{"role": "user", "content": "hi"}], add_generation_prompt=False))
    assert text == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer.eos_token_ids) == 2


@pytest.fixture(scope="module")
def llama_tokenizer(llama_model_dir) -> ModelTokenizer:
    return ModelTokenizer.from_dir(llama_model_dir, template_timeout_s=1.0)


def _pieces(tokenizer: ModelTokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.add([i]) for i in ids] + [detokenizer.flush()]


def _decode_stream_pieces(tokenizer: ModelTokenizer, ids: list[int]) -> list[str]:
    stream = DecodeStream(skip_special_tokens=True)
    return [stream.step(tokenizer.tokenizer, i) or "" for i in ids]


TEXTS = ["caf\u00e9 na\u00efve", "\u4f60\u597d\uff0c\u4e16\u754c", "a \U0001f680\U0001f389 b", "\u00e9\U0001f680\u4e2d",
         "hello world, the quick brown fox", "  two  spaces ", "x\n\ny"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_tokens_never_emit_a_partial_character(llama_tokenizer, text):
    ids = llama_tokenizer.encode(text, add_special_tokens=False)
    pieces = _pieces(llama_tokenizer, ids)
    assert "".join(pieces) == llama_tokenizer.decode(ids) and not any("\ufffd" in piece for piece in pieces)


def test_byte_fallback_rocket_appears_with_its_last_byte(llama_tokenizer):
    ids = llama_tokenizer.encode("a \U0001f680", add_special_tokens=False)
    assert llama_tokenizer.token_pieces(ids[-4:]) == ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]
    assert _pieces(llama_tokenizer, ids)[-5:] == ["", "", "", "\U0001f680", ""]
    broken = _pieces(llama_tokenizer, ids[:-1])
    assert broken[-1] == "\ufffd" * 3  # at the end only: ByteFallback shows each stray byte


@pytest.mark.parametrize("text", TEXTS)
def test_decode_stream_agrees_where_no_token_mixes_whole_and_partial_characters(tokenizer, llama_tokenizer, text):
    for tok in (tokenizer, llama_tokenizer):
        ids = tok.encode(text, add_special_tokens=False)
        assert _decode_stream_pieces(tok, ids) == _pieces(tok, ids)[:-1]


def test_decode_stream_is_not_exact_so_the_proxy_keeps_its_own(tokenizer):
    """tokenizers' DecodeStream holds back whole characters that precede a split one in the same
    token, and has no flush for a broken tail; IncrementalDetokenizer sends the whole ones at
    once. (It is faster, see IncrementalDetokenizer's note; both are far past any need, so
    exactness decides.)"""
    mixed = next(i for piece, i in sorted(tokenizer.tokenizer.get_vocab().items()) if _is_whole_then_partial(
        tokenizer.token_bytes(i)))
    tail = tokenizer.token_bytes(mixed)
    needed = _continuation_bytes(tail)
    byte_ids = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    ids = [mixed, *(byte_ids[bytes([b])] for b in needed)]
    whole_prefix = tail.decode("utf-8", errors="ignore")
    ours = _pieces(tokenizer, ids)
    stream = _decode_stream_pieces(tokenizer, ids)
    assert ours[0] == whole_prefix != "" and stream[0] == ""
    assert "".join(ours) == "".join(stream) == tokenizer.decode(ids)
    assert _decode_stream_pieces(tokenizer, ids[:1]) == [""] and _pieces(tokenizer, ids[:1])[-1] == "\ufffd"


def _is_whole_then_partial(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        return exc.start > 0 and exc.reason == "unexpected end of data"
    return False


def _continuation_bytes(raw: bytes) -> bytes:
    """The continuation bytes (0x80) completing raw's last, partial UTF-8 character."""
    lead = next(b for b in reversed(raw) if b & 0xC0 != 0x80)
    length = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    num_have = len(raw) - raw.rindex(bytes([lead]))
    return bytes([0x80] * (length - num_have))

