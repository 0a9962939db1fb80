"""vLLM's extra request fields, as vLLM gives them: skip_special_tokens=false keeps special
tokens in the text (transformers' decode with skip_special_tokens=False), include_stop_str_in_output
ends the text with the stop string that ended it, the token that stopped a request (EOS) is not
text unless asked for, guided_json is the JSON schema the output must follow (as response_format
json_schema), and so are structured_outputs' json and json_object; guided_regex, guided_choice and
guided_grammar (and structured_outputs' regex, choice and grammar) reach the nodes as the regex,
choices and EBNF grammar they enforce, a refusal of theirs (no parse) is a 400 naming the field,
and the proxy refuses one past its bounds or budget itself; spaces_between_special_tokens is
accepted (it applies to slow tokenizers only). structural_tag and whitespace patterns are 400s
naming the field, as are two grammars in one request."""

from __future__ import annotations

import json

import httpx
import pytest
import transformers

from engine import protocol
from engine import sampling_rules as rules
from engine.protocol import StructuredKind, StructuredOutput
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


def _refusal(proxy, body: dict, path: str = "/v1/completions") -> dict:
    start = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(proxy.base_url + path, json={"model": MODEL_NAME, **start, **body}, timeout=10)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def _sent_grammar(proxy, **fields):
    """The grammar the prefill node was asked to enforce for a request sent with the openai client."""
    proxy.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body=fields)
    return proxy.prefill[0].messages(protocol.PrefillRequest)[-1].sampling.structured


def test_structured_outputs_json_and_json_object_are_the_grammar(start_proxy):
    proxy = start_proxy()
    for given in (SCHEMA, json.dumps(SCHEMA)):
        structured = _sent_grammar(proxy, structured_outputs={"json": given, "disable_fallback": True,
                                                              "disable_additional_properties": True})
        assert structured.kind is StructuredKind.JSON_SCHEMA and json.loads(structured.json_schema) == SCHEMA
    assert _sent_grammar(proxy, structured_outputs={"json_object": True}).kind is StructuredKind.JSON_OBJECT
    reply = proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    assert reply.choices[0].finish_reason
    structured = proxy.prefill[0].messages(protocol.PrefillRequest)[-1].sampling.structured
    assert json.loads(structured.json_schema) == SCHEMA


REGEX = StructuredOutput(StructuredKind.REGEX, regex=r"\d{3}-[a-z]+")
CHOICE = StructuredOutput(StructuredKind.CHOICE, choices=("yes", 'say "no"'))
EBNF = StructuredOutput(StructuredKind.EBNF, grammar='root ::= "a" [0-9]*')
# Each field of a grammar beyond JSON, as sent, and the StructuredOutput the nodes are asked for.
GRAMMARS = [
    ({"guided_regex": REGEX.regex}, "guided_regex", REGEX),
    ({"guided_choice": list(CHOICE.choices)}, "guided_choice", CHOICE),
    ({"guided_grammar": EBNF.grammar}, "guided_grammar", EBNF),
    ({"structured_outputs": {"regex": REGEX.regex}}, "structured_outputs.regex", REGEX),
    ({"structured_outputs": {"choice": list(CHOICE.choices), "disable_any_whitespace": True}},
     "structured_outputs.choice", CHOICE),
    ({"structured_outputs": {"grammar": EBNF.grammar, "disable_fallback": True}}, "structured_outputs.grammar", EBNF),
]


@pytest.mark.parametrize("fields, param, structured", GRAMMARS)
def test_regex_choice_and_grammar_fields_are_the_grammar_the_nodes_enforce(proxy, fields, param, structured):
    assert _sent_grammar(proxy, **fields) == structured
    reply = proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=fields)
    assert reply.choices[0].finish_reason
    assert proxy.prefill[0].messages(protocol.PrefillRequest)[-1].sampling.structured == structured


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, param, structured", GRAMMARS)
def test_a_regex_or_grammar_the_node_cannot_parse_is_a_400_naming_the_field(start_proxy, fields, param, structured,
                                                                           stream):
    proxy = start_proxy(node={"fail_structured": True})  # the node refuses it as a bad grammar
    error = _refusal(proxy, {"max_tokens": 3, "stream": stream, **fields})
    assert error["param"] == param, error
    assert [r.sampling.structured for r in proxy.prefill[0].messages(protocol.PrefillRequest)] == [structured]


_COSTLY = "(a|b){10007}"
_MANY_CHOICES = [f"c{i}" for i in range(rules.MAX_NUM_GRAMMAR_CHOICES + 1)]
_BIG_GRAMMAR = "root ::= " + " | ".join(['"abcdefgh"'] * (rules.MAX_GRAMMAR_BYTES // 11 + 1))


@pytest.mark.parametrize("body, param, words", [
    ({"guided_regex": _COSTLY}, "guided_regex", "the regex is too costly to enforce: the regex '(a|b){10007}' "
                                                "spells out 20014 characters"),
    ({"guided_regex": "a*" * 40}, "guided_regex", "40 repetitions of open count"),
    ({"structured_outputs": {"regex": "(a+)+$"}}, "structured_outputs.regex", "repeats without bound"),
    ({"guided_regex": "a" * (rules.MAX_REGEX_BYTES + 1)}, "guided_regex",
     f"limit is {rules.MAX_REGEX_BYTES}"),
    ({"guided_grammar": _BIG_GRAMMAR}, "guided_grammar", f"limit is {rules.MAX_GRAMMAR_BYTES}"),
    ({"structured_outputs": {"grammar": _BIG_GRAMMAR}}, "structured_outputs.grammar", "structured.grammar has"),
    ({"guided_choice": _MANY_CHOICES}, "guided_choice", f"the limits are {rules.MAX_NUM_GRAMMAR_CHOICES} choices"),
    ({"structured_outputs": {"choice": ["x" * (rules.MAX_GRAMMAR_CHOICES_BYTES + 1)]}},
     "structured_outputs.choice", f"{rules.MAX_GRAMMAR_CHOICES_BYTES} bytes"),
    ({"guided_regex": ""}, "guided_regex", "at least 1 character"),
    ({"guided_choice": []}, "guided_choice", "at least 1 item"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "at least 1 character"),
    ({"guided_choice": "yes"}, "guided_choice", "list"),
])
def test_a_regex_choice_or_grammar_past_its_bounds_is_refused_before_any_node_is_asked(proxy, body, param, words):
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = _refusal(proxy, body, path)
        assert error["param"] == param and words in error["message"], error
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


@pytest.mark.parametrize("body, param, words", [
    ({"structural_tag": "{}"}, "structural_tag", "not supported"),
    ({"guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " ?"}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "not supported"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json": SCHEMA, "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "must be a JSON schema"),
    ({"structured_outputs": {"json": SCHEMA, "backend": "outlines"}}, "structured_outputs.backend", "not known"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": _COSTLY}}}, "structured_outputs.json",
     "too costly"),
    ({"structured_outputs": {"json": SCHEMA}, "guided_json": SCHEMA}, "guided_json", "give one"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "structured_outputs.json_object", "give one"),
    ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_regex", "guided_regex and guided_choice both"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "give one"),
    ({"guided_json": SCHEMA, "guided_grammar": 'root ::= "a"'}, "guided_json", "give one"),
    ({"guided_grammar": 'root ::= "a"', "structured_outputs": {"regex": "a"}}, "guided_grammar", "give one"),
])
def test_structured_outputs_the_nodes_cannot_enforce_are_refused_by_name(proxy, body, param, words):
    error = _refusal(proxy, body)
    assert error["param"] == param and words in error["message"], error
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


def test_a_forced_tool_call_leaves_no_room_for_another_grammar(proxy):
    tools = {"tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required"}
    for grammar, param in (({"guided_json": SCHEMA}, "guided_json"),
                           ({"guided_choice": ["a", "b"]}, "guided_choice"),
                           ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs.regex"),
                           ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object")):
        error = _refusal(proxy, {**tools, **grammar}, "/v1/chat/completions")
        assert error["param"] == param and "forced tool call" in error["message"], error
