"""One choice of a completion: tokens in, text deltas (stop strings applied) and logprobs out;
and the events its runner hands the response (one queue for all choices of a request)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from engine import protocol
from proxy.schemas import Prompt
from proxy.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopChecker, TextOptions


@dataclass
class Delta:
    """What one step added to a choice: its new text, tokens, and the finish_reason on the last."""

    text: str
    tokens: list[protocol.TokenLogprob]
    finish_reason: str | None = None


@dataclass(frozen=True)
class SubRequest:
    """One choice as the nodes see it: a prompt sampled once, under its own request_id.
    structured_param: the request field that asked for sampling.structured (blamed when a node
    refuses the grammar)."""

    request_id: str
    index: int
    prompt: Prompt
    sampling: protocol.SamplingOptions
    structured_param: str | None = None


@dataclass(frozen=True)
class ChoiceEvent:
    """One item of a request's event queue; the consumer matches on the subclass."""


@dataclass(frozen=True)
class ChoiceDelta(ChoiceEvent):
    """Choice index produced delta."""

    index: int
    delta: Delta


@dataclass(frozen=True)
class ChoiceDone(ChoiceEvent):
    """Choice index is complete (its last delta came before)."""

    index: int


@dataclass(frozen=True)
class ChoiceFailed(ChoiceEvent):
    """Choice index failed; error is what its request flow raised (see errors.api_error_of)."""

    index: int
    error: Exception


@dataclass(frozen=True)
class ClientGone(ChoiceEvent):
    """The HTTP client disconnected before its answer was complete."""


@dataclass
class ChoiceState:
    """The text, tokens and finish_reason of one choice so far."""

    index: int
    tokenizer: ModelTokenizer
    text_options: TextOptions
    wants_logprobs: bool = False
    text_offset: int = 0  # legacy logprobs: where the next token's text starts (after any echo)
    detokenizer: IncrementalDetokenizer = field(init=False)
    _offset_decoder: codecs.IncrementalDecoder = field(init=False)
    stop_checker: StopChecker = field(init=False)
    text: str = ""
    num_tokens: int = 0
    # Kept only where logprobs are asked for (a body's are made from them): a long stream's tokens would
    # otherwise stay in memory, and in every full collection's traversal, until it ends.
    tokens: list[protocol.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[protocol.TokenLogprob] | None = None  # one per prompt token, when asked for
    # How the decode node came by the prompt's KV ("pulled", "local", "fallback:<reason>"), once
    # it said; None when the request ended on its prefill node.
    kv_path: str | None = None

    def __post_init__(self) -> None:
        options = self.text_options
        self.detokenizer = IncrementalDetokenizer(self.tokenizer, options.skip_special_tokens)
        self.stop_checker = StopChecker(options.stops, options.include_stop_str_in_output)
        self._offset_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, tokens: list[protocol.TokenLogprob], finish_reason: str | None) -> Delta:
        """Absorb a step's tokens; finish_reason becomes "stop" at a stop string."""
        if self.finish_reason is not None:
            return Delta("", [], self.finish_reason)  # tokens past a stop string: dropped
        self.num_tokens += len(tokens)
        if self.wants_logprobs:
            self.tokens.extend(tokens)
        ids = [t.token_id for t in tokens]
        if finish_reason == "stop" and ids and not self.text_options.include_stop_str_in_output:
            # NOTE: as vLLM: the token that stopped the request (EOS, a stop_token_ids id) is not
            # part of the text, unless include_stop_str_in_output (it still counts, and has logprobs).
            ids = ids[:-1]
        text = self.stop_checker.feed(self.detokenizer.add(ids))
        if self.stop_checker.is_stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self.stop_checker.feed(self.detokenizer.flush())
            text += "" if self.stop_checker.is_stopped else self.stop_checker.flush()
            if self.stop_checker.is_stopped:
                finish_reason = "stop"
        if finish_reason == "abort":
            finish_reason = "stop"
        self.finish_reason = finish_reason
        self.text += text
        return Delta(text, tokens, finish_reason)

    def completion_logprobs(self, tokens: list[protocol.TokenLogprob]) -> dict | None:
        """The legacy /v1/completions logprobs object for these tokens (None if not asked for).
        Call once per token, in order: it advances text_offset."""
        if not self.wants_logprobs:
            return None
        texts = [self._label(t.token_id) for t in tokens]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            # A token ending inside a character adds nothing until the character completes.
            self.text_offset += len(self._offset_decoder.decode(self.tokenizer.token_bytes(token.token_id)))
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self._label(i): lp for i, lp in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def prompt_completion_logprobs(self) -> dict:
        """The legacy logprobs object of the prompt's tokens (echo): offsets from 0, the first
        token's logprob and top_logprobs null (nothing precedes it), as OpenAI and vLLM."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        entries = self.prompt_logprobs or []
        offsets, offset = [], 0
        for entry in entries:
            offsets.append(offset)
            offset += len(decoder.decode(self.tokenizer.token_bytes(entry.token_id)))
        return {
            "tokens": [self._label(t.token_id) for t in entries],
            "token_logprobs": [t.logprob for t in entries],
            "top_logprobs": [None if t.logprob is None else {self._label(i): lp for i, lp in t.top}
                             for t in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, tokens: list[protocol.TokenLogprob]) -> dict | None:
        """The chat logprobs object for these tokens (None if not asked for)."""
        if not self.wants_logprobs:
            return None
        return {"content": [self._chat_entry(t) for t in tokens]}

    def _chat_entry(self, token: protocol.TokenLogprob) -> dict:
        entry = self._chat_top(token.token_id, token.logprob)
        entry["top_logprobs"] = [self._chat_top(i, logprob) for i, logprob in token.top]
        return entry

    def _chat_top(self, token_id: int, logprob: float | None) -> dict:
        label = self._label(token_id)
        # as vLLM: a token named by its id has the name's bytes
        raw = label.encode() if self.text_options.tokens_as_ids else self.tokenizer.token_bytes(token_id)
        return {"token": label, "logprob": logprob, "bytes": list(raw)}

    def _label(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.text_options.tokens_as_ids else self.tokenizer.token_text(token_id)
