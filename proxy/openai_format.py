"""OpenAI response bodies and SSE chunks: one formatter per endpoint (completions, chat), made
once per request, with the same interface; chat answers may be tool calls (proxy.tool_calls)."""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod

import msgspec

from engine.protocol import TokenLogprob
from proxy.choices import ChoiceState, Delta, SubRequest
from proxy.errors import ApiError
from proxy.request_id import RequestId
from proxy.tool_calls import ToolCallStream, ToolPolicy

SSE_DONE = "data: [DONE]\n\n"


# NOTE: msgspec, not json.dumps: a tenth of the time, for every streamed chunk (benchmarks/proxy_capacity.py);
# compact, non-ASCII kept as json.dumps(ensure_ascii=False) kept it.
_ENCODER = msgspec.json.Encoder()


def _sse(data: dict) -> str:
    return f"data: {_ENCODER.encode(data).decode()}\n\n"


def _fingerprint(states) -> dict:
    """OpenAI's system_fingerprint, saying per response how the prompts' KV reached the decode
    node ("pdserve-kv:pulled", "...:local", "...:fallback:<reason>"; several choices' paths joined
    by ","); absent when no decode node said (the request ended on its prefill node)."""
    paths = sorted({state.kv_path for state in states if state.kv_path is not None})
    return {"system_fingerprint": "pdserve-kv:" + ",".join(paths)} if paths else {}


def _usage(subs: list[SubRequest], states: dict[int, ChoiceState]) -> dict:
    """Token counts; each prompt counts once, however many choices (n) it has."""
    num_prompt_tokens = sum(len(p.token_ids) for p in {id(s.prompt): s.prompt for s in subs}.values())
    num_completion_tokens = sum(state.num_tokens for state in states.values())
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class ResponseFormat(ABC):
    """The responses of one request: its id ("<prefix>-<request id>"; the nodes' ids for its
    choices append "-<index>", after a nonce when the client chose the id, as two clients may
    choose the same), whole body and SSE chunks. Subclasses give the endpoint's names and the
    shape of one choice."""

    endpoint: str  # the metrics label
    _id_prefix: str
    _object: str  # of the whole body
    _chunk_object: str

    def __init__(self, model: str, request_id: RequestId) -> None:
        self.model = model
        self.request_id = f"{self._id_prefix}-{request_id.value}"
        self._node_id_base = f"{self.request_id}-{uuid.uuid4().hex[:8]}" if request_id.is_given else self.request_id
        self.created = int(time.time())

    def choice_request_id(self, index: int) -> str:
        """The request_id the nodes know choice index by (unique among requests in flight)."""
        return f"{self._node_id_base}-{index}"

    def body(self, subs: list[SubRequest], states: dict[int, ChoiceState]) -> dict:
        """The whole (non-streaming) response once every choice is complete."""
        choices = [self._final_choice(sub, states[sub.index]) for sub in subs]
        return {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
                **_fingerprint(states.values()), "choices": choices, "usage": _usage(subs, states)}

    def opening_events(self, subs: list[SubRequest], states: dict[int, ChoiceState]) -> str:
        """The SSE events before any token (may be none)."""
        choices = (self._opening_choice(sub, states[sub.index]) for sub in subs)
        return "".join(_sse(self._chunk([choice])) for choice in choices if choice is not None)

    def delta_event(self, state: ChoiceState, delta: Delta) -> str:
        """The SSE event of a choice's delta; "" when it carries nothing (no text, logprobs or end)."""
        choice = self._delta_choice(state, delta)
        if choice["logprobs"] is None and choice["finish_reason"] is None and not delta.text:
            return ""
        return _sse({**self._chunk([choice]), **_fingerprint([state])})

    def usage_event(self, subs: list[SubRequest], states: dict[int, ChoiceState]) -> str:
        return _sse({**self._chunk([]), "usage": _usage(subs, states)})

    @staticmethod
    def error_event(error: ApiError) -> str:
        return _sse(error.body())

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    @abstractmethod
    def _opening_choice(self, sub: SubRequest, state: ChoiceState) -> dict | None:
        """The choice's streamed entry before its first token; None: nothing to send."""

    @abstractmethod
    def _delta_choice(self, state: ChoiceState, delta: Delta) -> dict:
        """The choice's streamed entry for one delta (has "logprobs" and "finish_reason")."""

    @abstractmethod
    def _final_choice(self, sub: SubRequest, state: ChoiceState) -> dict:
        """The choice's entry in the whole body."""


class CompletionFormat(ResponseFormat):
    """/v1/completions: text choices, legacy logprobs; echo puts the prompt before the text.
    With logprobs too, the prompt's tokens come first in the logprobs (the first one's null), and
    a stream sends the prompt with the choice's first tokens (its logprobs come with them)."""

    endpoint = "completions"
    _id_prefix = "cmpl"
    _object = "text_completion"
    _chunk_object = "text_completion"

    def __init__(self, model: str, request_id: RequestId, is_echo: bool) -> None:
        super().__init__(model, request_id)
        self.is_echo = is_echo
        self._unsent_echoes: dict[int, str] = {}  # choice index -> its echo, sent with its first delta

    def _opening_choice(self, sub: SubRequest, state: ChoiceState) -> dict | None:
        if not self.is_echo:
            return None
        text = self._echo(sub, state)
        state.text_offset = len(text)  # legacy logprobs count offsets from the start of the echo
        if sub.sampling.prompt_logprobs is not None:
            self._unsent_echoes[sub.index] = text
            return None
        return {"index": sub.index, "text": text, "logprobs": None, "finish_reason": None}

    def _delta_choice(self, state: ChoiceState, delta: Delta) -> dict:
        echo = self._unsent_echoes.pop(state.index, None)
        logprobs = state.completion_logprobs(delta.tokens)
        if echo is not None:
            logprobs = _joined(state.prompt_completion_logprobs(), logprobs)
        return {"index": state.index, "text": (echo or "") + delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    def _final_choice(self, sub: SubRequest, state: ChoiceState) -> dict:
        echo = self._echo(sub, state) if self.is_echo else ""
        state.text_offset = len(echo)
        logprobs = state.completion_logprobs(state.tokens)
        if state.prompt_logprobs is not None:
            logprobs = _joined(state.prompt_completion_logprobs(), logprobs)
        return {"index": sub.index, "text": echo + state.text, "logprobs": logprobs,
                "finish_reason": state.finish_reason}

    @staticmethod
    def _echo(sub: SubRequest, state: ChoiceState) -> str:
        """The prompt as text (as sent, else decoded)."""
        return sub.prompt.text if sub.prompt.text is not None else state.tokenizer.decode(sub.prompt.token_ids)


def _joined(first: dict, second: dict | None) -> dict:
    """Two legacy logprobs objects as one (the prompt's, then the completion's)."""
    return first if second is None else {key: first[key] + second[key] for key in first}


class ChatFormat(ResponseFormat):
    """/v1/chat/completions: assistant messages (streamed as deltas after a role), chat logprobs.
    With a ToolPolicy that parses the output, an answer that is a valid tool call comes as
    message.tool_calls (content null unless text preceded the calls); streamed, the text that
    may be a call is held back (ToolCallStream) and the calls go out in one tool_calls delta at
    the end, followed by a chunk with the finish_reason."""

    endpoint = "chat"
    _id_prefix = "chatcmpl"
    _object = "chat.completion"
    _chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, request_id: RequestId, tools: ToolPolicy | None = None) -> None:
        super().__init__(model, request_id)
        self.tools = tools if tools is not None and tools.is_parsed else None
        self._tool_streams: dict[int, ToolCallStream] = {}

    def delta_event(self, state: ChoiceState, delta: Delta) -> str:
        if self.tools is None:
            return super().delta_event(state, delta)
        stream = self._tool_streams.setdefault(state.index, ToolCallStream(self.tools.is_forced))
        text, tokens = stream.feed(delta.text, delta.tokens)
        events = self._content_event(state, text, tokens, None) if text else ""
        if delta.finish_reason is None:
            return events
        held_text, held_tokens = stream.take_held()
        parsed = self.tools.parse(state.text)
        if parsed is None:
            return events + self._content_event(state, held_text, held_tokens, delta.finish_reason)
        calls = [{"index": i, **call.to_openai()} for i, call in enumerate(parsed.calls)]
        tool_calls = {"index": state.index, "delta": {"tool_calls": calls},
                      "logprobs": state.chat_logprobs(held_tokens), "finish_reason": None}
        finish = {"index": state.index, "delta": {}, "logprobs": None, "finish_reason": self.tools.finish_reason}
        return events + _sse(self._chunk([tool_calls])) + _sse(self._chunk([finish]))

    def _content_event(self, state: ChoiceState, text: str, tokens: list[TokenLogprob],
                       finish_reason: str | None) -> str:
        return _sse({**self._chunk([self._delta_choice(state, Delta(text, tokens, finish_reason))]),
                     **_fingerprint([state])})

    def _opening_choice(self, sub: SubRequest, state: ChoiceState) -> dict | None:
        return {"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def _delta_choice(self, state: ChoiceState, delta: Delta) -> dict:
        return {"index": state.index, "delta": {"content": delta.text},
                "logprobs": state.chat_logprobs(delta.tokens), "finish_reason": delta.finish_reason}

    def _final_choice(self, sub: SubRequest, state: ChoiceState) -> dict:
        parsed = None if self.tools is None else self.tools.parse(state.text)
        if parsed is None:
            message, finish_reason = {"role": "assistant", "content": state.text}, state.finish_reason
        else:
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": [call.to_openai() for call in parsed.calls]}
            finish_reason = self.tools.finish_reason
        return {"index": sub.index, "message": message, "logprobs": state.chat_logprobs(state.tokens),
                "finish_reason": finish_reason}
