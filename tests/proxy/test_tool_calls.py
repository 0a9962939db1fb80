"""proxy.tool_calls alone: the schemas that force a call, parsing outputs into calls (bare JSON,
lists, <tool_call> tags; anything else stays content), and the streaming buffer, which sends
exactly what the whole answer holds whichever way the text is split."""

from __future__ import annotations

import json

import pytest

from engine.protocol import TokenLogprob
from proxy.tool_calls import ToolCallStream, ToolChoiceMode, ToolPolicy

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
NOW = {"name": "now"}  # no parameters
FUNCTIONS = {"get_weather": WEATHER, "now": NOW}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NOW_CALL = '{"name": "now", "arguments": {}}'


def policy(mode: ToolChoiceMode = ToolChoiceMode.AUTO, named: str | None = None,
           is_parallel: bool = True) -> ToolPolicy:
    return ToolPolicy(mode, FUNCTIONS, named, is_parallel)


def calls_of(text: str, **kwargs) -> tuple[str | None, list[tuple[str, dict]]] | None:
    parsed = policy(**kwargs).parse(text)
    return None if parsed is None else (parsed.content, [(c.name, c.arguments) for c in parsed.calls])


@pytest.mark.parametrize("text, want", [
    (CALL, (None, [("get_weather", {"city": "Paris"})])),
    (f"\n  {CALL}\n", (None, [("get_weather", {"city": "Paris"})])),
    (f"[{CALL}, {NOW_CALL}]", (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
    (f"<tool_call>{CALL}</tool_call>", (None, [("get_weather", {"city": "Paris"})])),
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{NOW_CALL}</tool_call>\n",
     (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
    (f"<tool_call>[{CALL}, {NOW_CALL}]</tool_call>", (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
    (f"<tool_call>{CALL}", (None, [("get_weather", {"city": "Paris"})])),  # stopped before the closing tag
    (f"Let me look.\n<tool_call>{CALL}</tool_call>", ("Let me look.\n", [("get_weather", {"city": "Paris"})])),
    (f"  \n<tool_call>{CALL}</tool_call>", (None, [("get_weather", {"city": "Paris"})])),
])
def test_valid_calls_are_parsed_plain_listed_or_tagged(text, want):
    assert calls_of(text) == want


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "",
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut short
    '{"name": "send_mail", "arguments": {}}',  # not a listed tool
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments not an object
    '{"name": "get_weather"}',  # no arguments
    '{"city": "Paris"}',
    "[]",
    f"[{CALL}, 3]",
    f"{CALL} and more",
    f"<tool_call>{CALL}</tool_call> and then some text",
    "<tool_call>not json</tool_call>",
    f"[note] <tool_call>{CALL}</tool_call>",  # starts like JSON: read as JSON only
    "[" * 100_000 + "]" * 100_000,  # a model's output nested past the parser's recursion limit
    "<tool_call>" + '{"a":' * 100_000,
])
def test_anything_but_valid_calls_is_content(text):
    assert calls_of(text) is None


def test_several_calls_need_parallel_tool_calls():
    assert calls_of(f"[{CALL}, {NOW_CALL}]", is_parallel=False) is None
    assert calls_of(f"[{CALL}]", is_parallel=False) == (None, [("get_weather", {"city": "Paris"})])


def test_calls_get_fresh_openai_ids_and_arguments_as_json_text():
    first, second = policy().parse(CALL).calls[0], policy().parse(CALL).calls[0]
    assert first.id.startswith("call_") and first.id != second.id
    entry = first.to_openai()
    assert entry["type"] == "function" and entry["function"]["name"] == "get_weather"
    assert json.loads(entry["function"]["arguments"]) == {"city": "Paris"}


def _one(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def test_forced_calls_get_the_schema_of_a_call():
    weather, now = _one("get_weather", WEATHER["parameters"]), _one("now", {"type": "object", "properties": {}})
    assert policy(ToolChoiceMode.REQUIRED).grammar_schema() == {"type": "array", "items": {"anyOf": [weather, now]},
                                                                 "minItems": 1}
    assert policy(ToolChoiceMode.REQUIRED, is_parallel=False).grammar_schema() == {"anyOf": [weather, now]}
    assert policy(ToolChoiceMode.NAMED, "now").grammar_schema() == now
    assert ToolPolicy(ToolChoiceMode.REQUIRED, {"now": NOW}, None, False).grammar_schema() == now
    assert policy(ToolChoiceMode.AUTO).grammar_schema() is None and policy(ToolChoiceMode.NONE).grammar_schema() is None
    assert policy(ToolChoiceMode.NAMED, "now").finish_reason == "stop"
    assert policy(ToolChoiceMode.REQUIRED).finish_reason == policy().finish_reason == "tool_calls"


def _streamed(text: str, piece_len: int, is_forced: bool) -> tuple[list[str], str, int]:
    """Feed text in pieces: (the content pieces sent while streaming, the held rest, tokens out)."""
    stream = ToolCallStream(is_forced)
    sent, num_tokens = [], 0
    for start in range(0, len(text), piece_len):
        out, tokens = stream.feed(text[start:start + piece_len], [TokenLogprob(start)])
        num_tokens += len(tokens)
        if out:
            sent.append(out)
    held, tokens = stream.take_held()
    return sent, held, num_tokens + len(tokens)


@pytest.mark.parametrize("text", [
    "Plain text, no call at all.",
    "  <tool_cat> is not a tag",
    f"Let me look.\n<tool_call>{CALL}</tool_call>",
    f"  \n<tool_call>{CALL}</tool_call>",
    f"\n{CALL}",
    f"[{CALL}]",
    "{not a call",
    "a < b <tool_c",
])
@pytest.mark.parametrize("piece_len", [1, 3, 7, 1000])
def test_auto_streaming_sends_text_at_once_and_holds_what_may_be_a_call(text, piece_len):
    sent, held, num_tokens = _streamed(text, piece_len, is_forced=False)
    assert "".join(sent) + held == text
    assert num_tokens == len(range(0, len(text), piece_len))  # every token's logprobs go out once
    parsed = policy().parse(text)
    if parsed is not None:  # the calls replace the held text; what went out is the content
        assert "".join(sent) == (parsed.content or "")
    elif not text.lstrip().startswith(("{", "[", "<tool_call>")) and piece_len == 1:
        assert len(sent) > 1  # plain text streams


def test_forced_streaming_holds_everything():
    assert _streamed(CALL, 2, is_forced=True) == ([], CALL, len(range(0, len(CALL), 2)))
