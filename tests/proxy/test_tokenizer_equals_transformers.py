"""The proxy tokenizes as transformers' AutoTokenizer does for a checkpoint of each supported family:
Llama (tiny), Qwen2, where the class transformers picks replaces tokenizer.json's pre-tokenizer (a
plain ByteLevel one in the file, Qwen2's own split pattern in transformers 5), and Mistral (a
SentencePiece-style BPE: byte fallback, "<s>" added to text prompts, the template in
tokenizer_config.json); built once in a child process and cached."""

from __future__ import annotations

import logging

import pytest
import transformers
from tokenizers import Tokenizer

from proxy import tokenizer as proxy_tokenizer
from proxy.templates import Conversation
from proxy.tokenizer import ModelTokenizer

TEXTS = ["a\n    b", "def f(a):\n    b = 1\n\n    return a  # x", "Hello, world! 123 4567", "naïve café — 日本語 😀",
         "  leading\ttabs\r\nx", "<|im_start|> in text <|im_end|>", "<s>[INST] in text [/INST]</s>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():\n    return 1"}]
# A second turn: the template writes the EOS token between turns.
TWO_TURNS = [*MESSAGES, {"role": "assistant", "content": "ok 日本"}, {"role": "user", "content": "and\tnaïve?"}]


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory):
    """One cache for the module (each build is a child importing transformers, a few seconds)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("tokenizer-cache")))
        yield


@pytest.fixture(params=["qwen2-tiny", "tiny", "mistral-tiny"])
def checkpoint(request):
    return request.getfixturevalue(request.param.replace("-", "_") + "_model_dir")


def test_prompt_ids_equal_autotokenizers_for_text_and_chat(checkpoint):
    ours = ModelTokenizer.from_dir(checkpoint, template_timeout_s=5.0)
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), repr(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), repr(text)
    for messages in (MESSAGES, TWO_TURNS):
        chat = ours.render_chat(Conversation(messages, add_generation_prompt=True))
        assert ours.encode(chat, add_special_tokens=False) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False), chat


def test_each_tokens_text_is_its_text_in_context(checkpoint):
    """Logprobs' token strings and text offsets: after the first token, the tokens' bytes add up to
    the decoded text (a SentencePiece token keeps the space its "▁" stands for)."""
    ours = ModelTokenizer.from_dir(checkpoint, template_timeout_s=5.0)
    for text in TEXTS[:4]:
        ids = ours.encode(text, add_special_tokens=False)
        head = ours.decode(ids[:1], skip_special_tokens=False).encode()
        assert b"".join(map(ours.token_bytes, ids[1:])) == ours.decode(ids, skip_special_tokens=False).encode()[
            len(head):], repr(text)


def test_the_qwen2_case_differs_from_the_file_alone(qwen2_tiny_model_dir):
    """What the proxy got wrong before: the file's own pre-tokenizer splits "a\\n    b" otherwise."""
    raw = Tokenizer.from_file(str(qwen2_tiny_model_dir / "tokenizer.json"))
    ours = ModelTokenizer.from_dir(qwen2_tiny_model_dir, template_timeout_s=5.0)
    assert any(ours.encode(t) != raw.encode(t).ids for t in TEXTS)


def test_built_once_then_read_from_the_cache(tiny_model_dir, monkeypatch):
    first = ModelTokenizer.from_dir(tiny_model_dir, template_timeout_s=5.0)

    def no_child(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(proxy_tokenizer.subprocess, "run", no_child)
    again = ModelTokenizer.from_dir(tiny_model_dir, template_timeout_s=5.0)
    assert again.encode(TEXTS[1]) == first.encode(TEXTS[1])


def test_where_transformers_cannot_build_it_the_file_serves_with_a_warning(tiny_model_dir, monkeypatch, caplog,
                                                                          tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "empty"))  # nothing cached: the child runs
    monkeypatch.setattr(proxy_tokenizer, "_BUILD_TOKENIZER", "raise SystemExit('no tokenizer class for this')")
    with caplog.at_level(logging.WARNING, logger="proxy.tokenizer"):
        ours = ModelTokenizer.from_dir(tiny_model_dir, template_timeout_s=5.0)
    assert any("could not build the tokenizer" in r.getMessage() and "no tokenizer class" in r.getMessage()
               for r in caplog.records)
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert ours.encode(TEXTS[1]) == raw.encode(TEXTS[1]).ids
