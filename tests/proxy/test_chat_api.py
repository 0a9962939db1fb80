"""/v1/chat/completions end to end against fake nodes: the prompt the nodes get is transformers'
apply_chat_template(tokenize=True) of the messages as an OpenAI client sends them (text parts,
tool calls, tool results), template failures are 400s naming them, and the Llama-style
tokenizer gets exactly one BOS in chat and in text prompts."""

from __future__ import annotations

import json

import httpx
import pytest
import transformers

from engine import protocol
from proxy.chat_schemas import ChatMessage
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.test_templates import ALTERNATING_TEMPLATE, TOOLS, TOOLS_TEMPLATE

_CHAT = "/v1/chat/completions"
OPENAI_TOOL_CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": "You help."}, {"type": "text", "text": "Briefly."}]},
    {"role": "user", "content": "Weather in Paris and Z\u00fcrich?", "name": "ann"},
    {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "{\"temp\": 21}"}]},
    {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "9:00"},
]
# What the template gets for it: vLLM's changes (parts joined by "\n", arguments parsed, ...).
TEMPLATE_MESSAGES = [
    {"role": "system", "content": "You help.\nBriefly."},
    {"role": "user", "content": "Weather in Paris and Z\u00fcrich?", "name": "ann"},
    {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "9:00"},
]


def _post(proxy, body: dict, path: str = _CHAT, **kwargs) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json={"model": MODEL_NAME, **body}, timeout=10, **kwargs)


def _prompt_ids(proxy) -> list[int]:
    return proxy.prefill[0].messages(protocol.PrefillRequest)[-1].prompt_token_ids


@pytest.fixture
def tools_proxy(start_proxy, tmp_path):
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return start_proxy(chat_template_path=str(path), max_model_len=2048)  # the tools fill ~600 tokens


def test_messages_reach_the_template_as_vllm_passes_them():
    parsed = [ChatMessage.model_validate(m).template_message() for m in OPENAI_TOOL_CONVERSATION]
    assert parsed == TEMPLATE_MESSAGES
    assert [list(m) for m in parsed] == [list(m) for m in OPENAI_TOOL_CONVERSATION]  # the client's key order
    empty_calls = ChatMessage.model_validate({"role": "assistant", "content": "ok", "tool_calls": []})
    assert empty_calls.template_message() == {"role": "assistant", "content": "ok"}


def test_tool_conversation_prompt_equals_transformers(tools_proxy, model_dir, tmp_path):
    response = _post(tools_proxy, {"messages": OPENAI_TOOL_CONVERSATION, "tools": TOOLS, "max_tokens": 3})
    assert response.status_code == 200, response.text
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    want = hf.apply_chat_template(TEMPLATE_MESSAGES, tools=TOOLS, chat_template=TOOLS_TEMPLATE,
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert _prompt_ids(tools_proxy) == want
    assert response.json()["usage"]["prompt_tokens"] == len(want)


def test_continue_final_message_prompt_equals_transformers(proxy, model_dir):
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two, "}]
    response = _post(proxy, {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
                             "max_tokens": 2})
    assert response.status_code == 200, response.text
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert _prompt_ids(proxy) == hf.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                                        return_dict=False)


def test_chat_template_kwargs_reach_the_template(start_proxy, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ greeting | default('none') }}:{{ messages[0].content }}")
    proxy = start_proxy(chat_template_path=str(path))
    assert _post(proxy, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                         "chat_template_kwargs": {"greeting": "hello"}}).status_code == 200
    assert proxy.prefill[0].messages(protocol.PrefillRequest)[-1].prompt_token_ids == _encode(proxy, "hello:hi")


def _encode(proxy, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(proxy.config.model_dir + "/tokenizer.json").encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "must alternate"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'mine' }}"}, "chat_template",
     "--trust-request-chat-template"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "messages", "not compatible"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}, "messages",
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0", "assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.0.tool_calls", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tools entries"),
    # as OpenAI: content null or missing only on an assistant message with tool calls
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", "needs content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user"}]}, "messages.1", "needs content"),
    ({"messages": [{"role": "user", "content": "x"}], "min_tokens": 10}, "min_tokens",
     "min_tokens (10) must not exceed max_tokens (1)"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}}}},
     "response_format", "points outside the schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"$defs": {"a": {"$ref": "file:///etc/passwd"}}}}}}, "response_format",
     "schema.$defs.a.$ref"),
    # the grammar budget, decided here before a node compiles anything
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "string", "pattern": "(a|b){10007}"}}}}, "response_format",
     "too costly to enforce: schema.pattern '(a|b){10007}' spells out 20014"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [{"type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string",
                                                                                        "pattern": "^(a+)+$"}}}}}]},
     "tools", "repeats without bound something that itself repeats"),
])
def test_template_and_message_errors_are_400s_naming_them(start_proxy, tmp_path, body, param, words):
    path = tmp_path / "alternating.jinja"
    path.write_text(ALTERNATING_TEMPLATE)
    proxy = start_proxy(chat_template_path=str(path))
    response = _post(proxy, {**body, "max_tokens": 1})
    error = response.json()["error"]
    assert response.status_code == 400 and words in error["message"] and error["param"] == param, error
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


def test_a_hanging_template_is_a_400_within_the_timeout(start_proxy, tmp_path):
    path = tmp_path / "hang.jinja"
    path.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    proxy = start_proxy(chat_template_path=str(path), chat_template_timeout_s=0.3)
    response = _post(proxy, {"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400 and "did not finish within 0.3 s" in response.json()["error"]["message"]
    assert httpx.get(proxy.base_url + "/health", timeout=2).status_code == 200


def test_trusted_request_templates_are_used(start_proxy):
    proxy = start_proxy(trust_request_chat_template=True)
    response = _post(proxy, {"messages": [{"role": "user", "content": "hi"}], "chat_template": "X{{ messages[0]."
                             "content }}", "max_tokens": 1})
    assert response.status_code == 200 and _prompt_ids(proxy) == _encode(proxy, "Xhi")


def test_llama_style_prompts_get_one_bos(start_proxy, llama_model_dir):
    proxy = start_proxy(model_dir=str(llama_model_dir))
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_model_dir))
    bos = hf.bos_token_id
    messages = [{"role": "user", "content": "hello world"}]
    assert _post(proxy, {"messages": messages, "max_tokens": 1}).status_code == 200
    chat_ids = _prompt_ids(proxy)
    assert chat_ids == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_ids.count(bos) == 1 and chat_ids[0] == bos
    assert _post(proxy, {"messages": messages, "max_tokens": 1, "add_special_tokens": True}).status_code == 200
    assert _prompt_ids(proxy) == [bos, *chat_ids]  # vLLM's add_special_tokens: the tokenizer's BOS as well
    assert _post(proxy, {"prompt": "hello world", "max_tokens": 1}, "/v1/completions").status_code == 200
    assert _prompt_ids(proxy) == hf("hello world")["input_ids"] and _prompt_ids(proxy)[0] == bos
    assert _post(proxy, {"prompt": "hello world", "max_tokens": 1, "add_special_tokens": False},
                 "/v1/completions").status_code == 200
    assert _prompt_ids(proxy) == hf("hello world", add_special_tokens=False)["input_ids"]
    assert _post(proxy, {"prompt": [7, 8, 9], "max_tokens": 1}, "/v1/completions").status_code == 200
    assert _prompt_ids(proxy) == [7, 8, 9]  # token ids as given
    echoed = _post(proxy, {"prompt": "hello world", "max_tokens": 1, "echo": True}, "/v1/completions").json()
    assert echoed["choices"][0]["text"].startswith("hello world")


def test_streamed_chat_with_tools_matches_whole(tools_proxy):
    body = {"messages": OPENAI_TOOL_CONVERSATION, "tools": TOOLS, "max_tokens": 4}
    whole = _post(tools_proxy, body).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", tools_proxy.base_url + _CHAT, json={"model": MODEL_NAME, **body, "stream": True},
                      timeout=10) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == whole


def test_local_schema_references_are_accepted(proxy):
    """A $ref inside the schema ("#/...") is the schema's own: served (the grammar library
    resolves it), unlike one to a URL or a file."""
    schema = {"$defs": {"name": {"type": "string"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/name"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    response = _post(proxy, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                             "response_format": response_format})
    assert response.status_code == 200, response.text
    [request] = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert json.loads(request.sampling.structured.json_schema) == schema
