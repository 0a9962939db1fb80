"""vLLM's extra request fields, as vLLM gives them: skip_special_tokens=false keeps special
tokens in the text (transformers' decode with skip_special_tokens=False), include_stop_str_in_output
ends the text with the stop string that ended it, the token that stopped a request (EOS) is not
text unless asked for, guided_json is the JSON schema the output must follow (as response_format
json_schema), spaces_between_special_tokens is accepted (it applies to slow tokenizers only)."""

from __future__ import annotations

import json

import httpx
import pytest
import transformers

from engine import protocol
from engine.protocol import StructuredKind
from tests.proxy.conftest import MODEL_NAME

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def scripted_ids(start_proxy, hf_tokenizer):
    """scripted_ids(ids) -> a proxy whose nodes answer ids (then stop: the last one is EOS)."""
    eos = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def start(ids: list[int]):
        return start_proxy(node={"script": ids, "eos_token_id": eos})

    return start


def _complete(proxy, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 40, **fields}
    response = httpx.post(proxy.base_url + "/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _streamed_text(proxy, **fields) -> str:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 40, "stream": True, **fields}
    with httpx.stream("POST", proxy.base_url + "/v1/completions", json=body, timeout=10) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines if json.loads(line)["choices"])


def test_special_tokens_stay_in_the_text_when_asked_as_transformers_decodes_them(scripted_ids, hf_tokenizer):
    marker = hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    eos = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    words = hf_tokenizer.encode("hello world", add_special_tokens=False)
    ids = [*words, marker, *words, eos]
    proxy = scripted_ids(ids)
    kept = hf_tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert "<|im_start|>" in kept
    assert _complete(proxy, skip_special_tokens=False)["text"] == kept
    assert _streamed_text(proxy, skip_special_tokens=False) == kept
    assert _complete(proxy)["text"] == hf_tokenizer.decode(ids, skip_special_tokens=True)
    # The EOS that stopped the request is text only with include_stop_str_in_output (as vLLM).
    assert _complete(proxy, skip_special_tokens=False, include_stop_str_in_output=True)["text"] == (
        hf_tokenizer.decode(ids, skip_special_tokens=False))
    assert _complete(proxy, spaces_between_special_tokens=False)["finish_reason"] == "stop"


def test_the_stop_string_ends_the_text_when_asked(scripted_ids, hf_tokenizer):
    ids = hf_tokenizer.encode("hello world, the quick brown fox", add_special_tokens=False)
    proxy = scripted_ids(ids + ids)
    without = _complete(proxy, stop=["quick"])
    assert without["text"] == "hello world, the " and without["finish_reason"] == "stop"
    assert _complete(proxy, stop=["quick"], include_stop_str_in_output=True)["text"] == "hello world, the quick"
    assert _streamed_text(proxy, stop=["quick"], include_stop_str_in_output=True) == "hello world, the quick"


def test_guided_json_is_the_schema_the_output_must_follow(start_proxy):
    proxy = start_proxy()
    for given in (SCHEMA, json.dumps(SCHEMA)):
        _complete(proxy, guided_json=given, max_tokens=2)
        structured = proxy.prefill[0].messages(protocol.PrefillRequest)[-1].sampling.structured
        assert structured.kind is StructuredKind.JSON_SCHEMA and json.loads(structured.json_schema) == SCHEMA
    for body, message in (({"guided_json": "[1, 2]"}, "guided_json must be a JSON schema"),
                          ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "give one"),
                          ({"guided_json": {"type": "string", "pattern": "(a|b){10007}"}}, "too costly")):
        response = httpx.post(proxy.base_url + "/v1/completions", timeout=10,
                              json={"model": MODEL_NAME, "prompt": "hi", **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "guided_json"
