"""logit_bias, response_format, tools with tool_choice, and echo with logprobs against fake
nodes: each request field becomes the SamplingOptions the nodes get, bad values are 400s naming
the field, tool calls come back parsed (whole and streamed, read by the official openai client),
and echo puts the prompt's logprobs before the completion's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from tokenizers import Tokenizer

from engine import protocol
from engine.protocol import StructuredKind, StructuredOutput
from engine.sampling_rules import MAX_JSON_SCHEMA_BYTES
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fake_node import fake_prompt_logprobs

_CHAT = "/v1/chat/completions"
_USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                      "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "now"}},
]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _post(proxy, body: dict, path: str = _CHAT, **kwargs) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json={"model": MODEL_NAME, **body}, timeout=10, **kwargs)


def _sampling(proxy, body: dict, path: str = _CHAT) -> protocol.SamplingOptions:
    """The SamplingOptions the prefill node got for body."""
    base = {"messages": _USER} if path == _CHAT else {"prompt": "hi"}
    response = _post(proxy, {**base, "max_tokens": 2, **body}, path)
    assert response.status_code == 200, response.text
    return proxy.prefill[0].messages(protocol.PrefillRequest)[-1].sampling


def _refusal(proxy, body: dict, path: str = _CHAT) -> dict:
    """The error of a 400 for body; no node heard of the request."""
    base = {"messages": _USER} if path == _CHAT else {"prompt": "hi"}
    response = _post(proxy, {**base, **body}, path)
    assert response.status_code == 400, response.text
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []
    return response.json()["error"]


# ---- request -> SamplingOptions ---------------------------------------------------------------


@pytest.mark.parametrize("path", [_CHAT, "/v1/completions"])
def test_logit_bias_reaches_the_nodes_with_int_token_ids(proxy, path):
    assert _sampling(proxy, {"logit_bias": {"5": 10, "17": -100, "3": 0.5}}, path).logit_bias == {
        5: 10.0, 17: -100.0, 3: 0.5}
    assert _sampling(proxy, {"logit_bias": {}}, path).logit_bias is None
    assert _sampling(proxy, {}, path).logit_bias is None


@pytest.mark.parametrize("path", [_CHAT, "/v1/completions"])
def test_response_format_becomes_the_structured_output(proxy, path):
    json_schema = {"name": "answer", "description": "yes or no", "schema": SCHEMA, "strict": True}
    structured = _sampling(proxy, {"response_format": {"type": "json_schema", "json_schema": json_schema}},
                           path).structured
    assert structured.kind is StructuredKind.JSON_SCHEMA and json.loads(structured.json_schema) == SCHEMA
    assert _sampling(proxy, {"response_format": {"type": "json_object"}}, path).structured == StructuredOutput(
        StructuredKind.JSON_OBJECT)
    assert _sampling(proxy, {"response_format": {"type": "text"}}, path).structured is None
    assert _sampling(proxy, {}, path).structured is None


def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def test_forced_tool_choice_becomes_the_schema_of_a_call(proxy):
    weather, now = _call_schema("get_weather", WEATHER_PARAMETERS), _call_schema("now", {"type": "object",
                                                                                        "properties": {}})

    def schema(body: dict) -> dict | None:
        structured = _sampling(proxy, {"tools": TOOLS, **body}).structured
        if structured is None:
            return None
        assert structured.kind is StructuredKind.JSON_SCHEMA
        return json.loads(structured.json_schema)

    assert schema({"tool_choice": "required"}) == {"type": "array", "items": {"anyOf": [weather, now]},
                                                   "minItems": 1}
    assert schema({"tool_choice": "required", "parallel_tool_calls": False}) == {"anyOf": [weather, now]}
    assert schema({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}) == weather
    for not_forced in ({"tool_choice": "auto"}, {"tool_choice": "none"}, {}):
        assert schema(not_forced) is None
    assert _sampling(proxy, {"tool_choice": "none"}).structured is None  # "none" needs no tools


@pytest.mark.parametrize("body, want", [
    ({"echo": True, "logprobs": 3}, 3),
    ({"echo": True, "logprobs": 0}, 0),
    ({"echo": True}, None),
    ({"logprobs": 2}, None),
])
def test_echo_with_logprobs_asks_for_prompt_logprobs(proxy, body, want):
    sampling = _sampling(proxy, body, "/v1/completions")
    assert sampling.prompt_logprobs == want
    assert sampling.logprobs == body.get("logprobs")


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("logit_bias, named", [
    ({"abc": 1, "5": 1}, "'abc'"),
    ({"-1": 1}, "'-1'"),
    ({"1.5": 1}, "'1.5'"),
    ({" 7": 1}, "' 7'"),
    ({"5": 101}, "101"),
    ({"5": -100.5}, "-100.5"),
    ({"400": 1, "5": 1}, "[400]"),  # the vocabulary has 400 tokens
    ({"5": True}, "a valid number"),  # param "logit_bias.5"
])
@pytest.mark.parametrize("path", [_CHAT, "/v1/completions"])
def test_bad_logit_bias_is_refused_naming_the_bad_entries(proxy, logit_bias, named, path):
    error = _refusal(proxy, {"logit_bias": logit_bias}, path)
    assert error["param"].startswith("logit_bias") and named in error["message"], error


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [SCHEMA]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}},
     "response_format.json_schema.extra"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * MAX_JSON_SCHEMA_BYTES]}}},
     "response_format"),
])
@pytest.mark.parametrize("path", [_CHAT, "/v1/completions"])
def test_bad_response_format_is_refused(proxy, response_format, param, path):
    assert _refusal(proxy, {"response_format": response_format}, path)["param"] == param


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_mail"}}}, "tool_choice",
     "'send_mail'"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "forced tool call"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "parameters"),
])
def test_bad_tool_choice_is_refused(proxy, body, param, words):
    error = _refusal(proxy, body)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
])
def test_a_grammar_the_node_refuses_is_a_400_naming_the_field(start_proxy, body, param, stream):
    proxy = start_proxy(node={"fail_structured": True})
    response = _post(proxy, {"messages": _USER, "max_tokens": 3, "stream": stream, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert _post(proxy, {"messages": _USER, "max_tokens": 3}).status_code == 200  # others go on


# ---- tool calls in answers --------------------------------------------------------------------


@pytest.fixture
def scripted(start_proxy, tokenizer):
    """scripted(text) -> a proxy whose nodes answer text, then EOS (the script's token count)."""
    eos = tokenizer.token_to_id("<|endoftext|>")

    def start(text: str):
        ids = tokenizer.encode(text).ids
        return start_proxy(node={"script": ids + [eos], "eos_token_id": eos}), len(ids) + 1

    return start


@pytest.mark.parametrize("tool_choice, finish_reason", [
    (None, "tool_calls"), ("auto", "tool_calls"), ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
])
def test_a_call_comes_back_as_tool_calls(scripted, tool_choice, finish_reason):
    proxy, num_tokens = scripted(CALL)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    reply = proxy.client().chat.completions.create(model=MODEL_NAME, messages=_USER, tools=TOOLS, max_tokens=200,
                                                   **extra)
    choice = reply.choices[0]
    assert choice.finish_reason == finish_reason and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.usage.completion_tokens == num_tokens


def test_tagged_calls_after_text_keep_the_text_as_content(scripted):
    text = f"Let me check.\n<tool_call>{CALL}</tool_call>\n<tool_call>{{\"name\": \"now\", \"arguments\": {{}}}}"
    proxy, _ = scripted(text)
    choice = proxy.client().chat.completions.create(model=MODEL_NAME, messages=_USER, tools=TOOLS,
                                                    max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "now"]
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris"}, {}]
    assert len({c.id for c in choice.message.tool_calls}) == 2


@pytest.mark.parametrize("text, body", [
    (CALL, {"tool_choice": "none"}),  # tools reach the template; the output is not read
    ('{"name": "send_mail", "arguments": {}}', {}),  # not a listed tool
    ("It is sunny.", {"tool_choice": "required"}),  # a forced call cut short (here: a script)
    (f"[{CALL}, {CALL}]", {"parallel_tool_calls": False}),
])
def test_output_that_is_no_valid_call_stays_content(scripted, text, body):
    proxy, _ = scripted(text)
    choice = proxy.client().chat.completions.create(model=MODEL_NAME, messages=_USER, tools=TOOLS, max_tokens=200,
                                                    **body).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_streamed_call_is_one_tool_calls_delta_then_the_finish(scripted, tool_choice):
    proxy, num_tokens = scripted(f"[{CALL}]")
    client = proxy.client()
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=_USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, stream=True,
        logprobs=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(not c.choices[0].delta.content for c in with_choices)  # nothing sent as text
    [tool_chunk] = [c for c in with_choices if c.choices[0].delta.tool_calls]
    [call] = tool_chunk.choices[0].delta.tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    assert with_choices[-1].choices[0].delta.tool_calls is None
    assert sum(len(c.choices[0].logprobs.content) for c in with_choices if c.choices[0].logprobs) == num_tokens
    assert chunks[-1].usage.completion_tokens == num_tokens

    # The client's own accumulator reads the same call from the deltas.
    with client.chat.completions.stream(model=MODEL_NAME, messages=_USER, tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=200) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert final.choices[0].finish_reason == "tool_calls"


def test_streamed_text_before_tagged_call_goes_out_as_it_comes(scripted):
    text = f"Sure, checking the weather for you now.\n<tool_call>{CALL}</tool_call>"
    proxy, _ = scripted(text)
    chunks = [c for c in proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=_USER, tools=TOOLS, max_tokens=200, stream=True) if c.choices]
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(contents) > 3 and "".join(contents) == "Sure, checking the weather for you now.\n"
    [tool_chunk] = [c for c in chunks if c.choices[0].delta.tool_calls]
    assert tool_chunk.choices[0].delta.tool_calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body", [{}, {"tool_choice": "required"}, {"tool_choice": "none"}])
def test_streamed_text_that_is_no_call_equals_the_whole_answer(scripted, body):
    text = '{"name": "send_mail", "arguments": {}} and plain text'
    proxy, num_tokens = scripted(text)
    chunks = [c for c in proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=_USER, tools=TOOLS, max_tokens=200, stream=True, logprobs=True, **body)
        if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert all(c.choices[0].delta.tool_calls is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == num_tokens


def test_plain_answers_stream_token_by_token_with_tools(scripted):
    proxy, num_tokens = scripted("The weather in Paris is sunny today.")
    chunks = [c for c in proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=_USER, tools=TOOLS, max_tokens=200, stream=True) if c.choices]
    assert sum(bool(c.choices[0].delta.content) for c in chunks) > num_tokens // 2


# ---- echo with logprobs -----------------------------------------------------------------------


def _check_echo_logprobs(logprobs, prompt_ids: list[int], num_completion: int, num_top: int, tokenizer,
                         vocab_size: int) -> None:
    want = fake_prompt_logprobs(prompt_ids, num_top, vocab_size)
    num_prompt = len(prompt_ids)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_prompt + num_completion
    assert logprobs.token_logprobs[:num_prompt] == [w.logprob for w in want]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[:num_prompt] == [tokenizer.decode([t]) for t in prompt_ids]
    assert [len(top) for top in logprobs.top_logprobs[1:num_prompt]] == [num_top] * (num_prompt - 1)
    assert logprobs.token_logprobs[num_prompt:] == [-0.5] * num_completion  # the fake model's
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "colocated"])
def test_echo_with_logprobs_puts_the_prompt_logprobs_first(start_proxy, tokenizer, vocab_size, num_prefill):
    proxy = start_proxy(num_prefill=num_prefill)
    prompt = "hello world, the quick"
    prompt_ids = tokenizer.encode(prompt).ids
    result = proxy.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, echo=True,
                                               logprobs=2, n=2)
    for choice in result.choices:
        assert choice.text.startswith(prompt)
        _check_echo_logprobs(choice.logprobs, prompt_ids, 4, 2, tokenizer, vocab_size)
        assert choice.logprobs.text_offset[len(prompt_ids)] == len(prompt)  # the completion's start after the echo
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == 8

    chunks = [c for c in proxy.client().completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=4,
                                                           echo=True, logprobs=2, stream=True) if c.choices]
    assert chunks[0].choices[0].text.startswith(tokenizer.decode(prompt_ids))  # the echo with the first token
    streamed = SimpleNamespace(**{
        key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
    _check_echo_logprobs(streamed, prompt_ids, 4, 2, tokenizer, vocab_size)
    assert "".join(c.choices[0].text for c in chunks) == result.choices[0].text


def test_echo_without_logprobs_streams_the_prompt_first(proxy):
    chunks = [c for c in proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2,
                                                           echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == "hello" and chunks[0].choices[0].logprobs is None
