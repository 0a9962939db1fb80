"""OpenAI response bodies and SSE chunks: one formatter per endpoint (completions, chat), made
once per request, with the same interface."""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod

from proxy.choices import ChoiceState, Delta, SubRequest
from proxy.errors import ApiError
from proxy.request_id import RequestId

SSE_DONE = "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


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
                "choices": choices, "usage": _usage(subs, states)}

    def opening_events(self, subs: list[SubRequest], states: dict[int, ChoiceState]) -> str:
        """The SSE events before any token (may be none)."""
        choices = (self._opening_choice(sub, states[sub.index]) for sub in subs)
        return "".join(_sse(self._chunk([choice])) for choice in choices if choice is not None)

    def delta_event(self, state: ChoiceState, delta: Delta) -> str:
        """The SSE event of a choice's delta; "" when it carries nothing (no text, logprobs or end)."""
        choice = self._delta_choice(state, delta)
        if choice["logprobs"] is None and choice["finish_reason"] is None and not delta.text:
            return ""
        return _sse(self._chunk([choice]))

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
    """/v1/completions: text choices, legacy logprobs; echo puts the prompt before the text."""

    endpoint = "completions"
    _id_prefix = "cmpl"
    _object = "text_completion"
    _chunk_object = "text_completion"

    def __init__(self, model: str, request_id: RequestId, is_echo: bool) -> None:
        super().__init__(model, request_id)
        self.is_echo = is_echo

    def _opening_choice(self, sub: SubRequest, state: ChoiceState) -> dict | None:
        if not self.is_echo:
            return None
        text = self._echo(sub, state)
        state.text_offset = len(text)  # legacy logprobs count offsets from the start of the echo
        return {"index": sub.index, "text": text, "logprobs": None, "finish_reason": None}

    def _delta_choice(self, state: ChoiceState, delta: Delta) -> dict:
        return {"index": state.index, "text": delta.text, "logprobs": state.completion_logprobs(delta.tokens),
                "finish_reason": delta.finish_reason}

    def _final_choice(self, sub: SubRequest, state: ChoiceState) -> dict:
        echo = self._echo(sub, state) if self.is_echo else ""
        state.text_offset = len(echo)
        return {"index": sub.index, "text": echo + state.text, "logprobs": state.completion_logprobs(state.tokens),
                "finish_reason": state.finish_reason}

    @staticmethod
    def _echo(sub: SubRequest, state: ChoiceState) -> str:
        """The prompt as text (as sent, else decoded)."""
        return sub.prompt.text if sub.prompt.text is not None else state.tokenizer.decode(sub.prompt.token_ids)


class ChatFormat(ResponseFormat):
    """/v1/chat/completions: assistant messages (streamed as deltas after a role), chat logprobs."""

    endpoint = "chat"
    _id_prefix = "chatcmpl"
    _object = "chat.completion"
    _chunk_object = "chat.completion.chunk"

    def _opening_choice(self, sub: SubRequest, state: ChoiceState) -> dict | None:
        return {"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def _delta_choice(self, state: ChoiceState, delta: Delta) -> dict:
        return {"index": state.index, "delta": {"content": delta.text},
                "logprobs": state.chat_logprobs(delta.tokens), "finish_reason": delta.finish_reason}

    def _final_choice(self, sub: SubRequest, state: ChoiceState) -> dict:
        return {"index": sub.index, "message": {"role": "assistant", "content": state.text},
                "logprobs": state.chat_logprobs(state.tokens), "finish_reason": state.finish_reason}
