"""Tool calls in chat answers: a request's tool_choice as a ToolPolicy, the JSON schema that
forces a call (tool_choice "required" or a named function), and a model's output parsed into
OpenAI tool_calls, whole or while it streams.

A call is written as Hermes-style and SmolLM2-style templates teach it: a JSON object
{"name": ..., "arguments": {...}} or a list of them, bare, or each in <tool_call>...</tool_call>
tags (text before the first tag is the message's content)."""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import TokenLogprob
from proxy import limits

TOOL_CALL_TAG = "<tool_call>"
TOOL_CALL_END_TAG = "</tool_call>"
_NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a function without parameters takes none


class ToolChoiceMode(enum.StrEnum):
    NONE = "none"  # tools reach the template only; the output is text
    AUTO = "auto"  # the output is parsed: a valid call becomes tool_calls, anything else content
    REQUIRED = "required"  # a grammar forces a call of some tool
    NAMED = "named"  # a grammar forces a call of one named tool


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=_new_call_id)

    def to_openai(self) -> dict:
        """The call as OpenAI's message.tool_calls entry (arguments as JSON text)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class ParsedOutput:
    """A model's output read as tool calls: the text before them (None if blank) and the calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolPolicy:
    """What a chat request's tools and tool_choice ask of its output. functions: each tool's
    "function" object by name, in the request's order; named: the forced tool (NAMED only);
    is_parallel: more than one call may come in one answer (parallel_tool_calls)."""

    mode: ToolChoiceMode
    functions: dict[str, dict[str, Any]]
    named: str | None = None
    is_parallel: bool = True

    @property
    def is_parsed(self) -> bool:
        return self.mode is not ToolChoiceMode.NONE

    @property
    def is_forced(self) -> bool:
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)

    @property
    def finish_reason(self) -> str:
        """An answer made of tool calls ends with this (OpenAI: "stop" when one was named)."""
        return "stop" if self.mode is ToolChoiceMode.NAMED else "tool_calls"

    def grammar_schema(self) -> dict[str, Any] | None:
        """The JSON schema of a forced call; None unless forced. REQUIRED: any tool's call (a
        non-empty array of them when is_parallel); NAMED: one call of that tool."""
        if self.mode is ToolChoiceMode.NAMED:
            return _call_schema(self.named, self.functions[self.named])
        if self.mode is not ToolChoiceMode.REQUIRED:
            return None
        calls = [_call_schema(name, function) for name, function in self.functions.items()]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "array", "items": one, "minItems": 1} if self.is_parallel else one

    def parse(self, text: str) -> ParsedOutput | None:
        """The output as tool calls, or None when it is not one or more valid calls (a listed
        tool's name and an object of arguments; at most one call unless is_parallel). Each
        parse gives the calls new ids."""
        stripped = text.strip()
        if stripped.startswith(("{", "[")):
            content, calls = None, self._calls_in_json(stripped)
        else:
            tag_idx = text.find(TOOL_CALL_TAG)
            if tag_idx < 0:
                return None
            content, calls = text[:tag_idx] if text[:tag_idx].strip() else None, self._tagged_calls(text[tag_idx:])
        if not calls or (len(calls) > 1 and not self.is_parallel):
            return None
        return ParsedOutput(content, calls)

    def _tagged_calls(self, text: str) -> list[ToolCall] | None:
        """Calls in a run of <tool_call>JSON</tool_call> blocks with only whitespace between
        (the last closing tag may be missing: the model stopped right after the JSON)."""
        calls: list[ToolCall] = []
        rest = text
        while rest:
            if not rest.startswith(TOOL_CALL_TAG):
                return None
            body, _, rest = rest[len(TOOL_CALL_TAG):].partition(TOOL_CALL_END_TAG)
            found = self._calls_in_json(body.strip())
            if found is None:
                return None
            calls += found
            rest = rest.lstrip()
        return calls

    def _calls_in_json(self, text: str) -> list[ToolCall] | None:
        try:
            value = limits.loads(text)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [self._call(item) for item in items]
        return None if not calls or None in calls else calls

    def _call(self, item: Any) -> ToolCall | None:
        if not isinstance(item, dict):
            return None
        name, arguments = item.get("name"), item.get("arguments")
        if not isinstance(name, str) or name not in self.functions or not isinstance(arguments, dict):
            return None
        return ToolCall(name, arguments)


def _call_schema(name: str, function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": function.get("parameters") or _NO_PARAMETERS},
            "required": ["name", "arguments"], "additionalProperties": False}


class _Phase(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace, or the start of a tag, so far
    CONTENT = "content"  # text: streamed, up to a <tool_call> tag
    HELD = "held"  # a possible call: held until the end


class ToolCallStream:
    """One streamed choice's text, held back while it may be a tool call. Forced: all of it is
    held. Auto: text that starts like JSON ("{", "[") or a <tool_call> tag is held; other text
    goes out as it comes, up to a <tool_call> tag (a possible tag's beginning waits for the
    next text). At the end the caller parses the whole text and sends either the calls or
    take_held() as content, so what is sent always equals the non-streamed answer."""

    def __init__(self, is_forced: bool) -> None:
        self._phase = _Phase.HELD if is_forced else _Phase.UNDECIDED
        self._text = ""
        self._tokens: list[TokenLogprob] = []

    def feed(self, text: str, tokens: list[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
        """Take a delta; returns the content that may go out now and the tokens (for logprobs)
        that go with it (empty when all is held)."""
        self._text += text
        self._tokens += tokens
        if self._phase is _Phase.UNDECIDED:
            start = self._text.lstrip()
            if start.startswith(("{", "[", TOOL_CALL_TAG)):
                self._phase = _Phase.HELD
            elif start and not TOOL_CALL_TAG.startswith(start):
                self._phase = _Phase.CONTENT
        if self._phase is not _Phase.CONTENT:
            return "", []
        tag_idx = self._text.find(TOOL_CALL_TAG)
        if tag_idx >= 0:
            self._phase = _Phase.HELD
            cut = tag_idx
        else:
            cut = len(self._text) - _partial_tag_length(self._text)
        if not cut:
            return "", []
        out, self._text = self._text[:cut], self._text[cut:]
        out_tokens, self._tokens = self._tokens, []
        return out, out_tokens

    def take_held(self) -> tuple[str, list[TokenLogprob]]:
        """At the end: the text and tokens still held back."""
        held = self._text, self._tokens
        self._text, self._tokens = "", []
        return held


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of text that begins a <tool_call> tag."""
    for length in range(min(len(text), len(TOOL_CALL_TAG) - 1), 0, -1):
        if TOOL_CALL_TAG.startswith(text[-length:]):
            return length
    return 0
