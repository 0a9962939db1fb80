"""OpenAI request bodies (pydantic, strictly typed) and the prompts and sampling options they ask
for; every sampling default and range comes from engine.protocol."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.protocol import SAMPLING_RANGES, SamplingError, SamplingOptions, check_sampling
from proxy.errors import ApiError, from_sampling, from_validation
from proxy.tokenizer import ModelTokenizer

MAX_N = 64  # choices per prompt a request may ask for

_DEFAULTS = SamplingOptions()
_RANGES = {name: (low, high, is_low_allowed) for name, low, high, is_low_allowed in SAMPLING_RANGES}

# NOTE: strict: "10" is not a number and "yes" not a boolean, as at OpenAI (JSON gives the
# real types; lax mode would quietly coerce them).
_STRICT = ConfigDict(strict=True, extra="ignore")


def _sampling_field(option: str) -> Any:
    """A pydantic Field with the default and the range engine.protocol gives the sampling option
    (out-of-range values fail validation naming the request field)."""
    return Field(default=getattr(_DEFAULTS, option), **_bounds(option))


def _limit_field(option: str) -> Any:
    """As _sampling_field, but None (the default) means "not set": the proxy picks the value."""
    return Field(default=None, **_bounds(option))


def _bounds(option: str) -> dict[str, float]:
    low, high, is_low_allowed = _RANGES[option]
    bounds = {}
    if low is not None:
        bounds["ge" if is_low_allowed else "gt"] = low
    if high is not None:
        bounds["le"] = high
    return bounds


@dataclass(frozen=True)
class Prompt:
    """One prompt as token ids; text is the prompt as sent when it came as text (for echo)."""

    token_ids: list[int]
    text: str | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields both endpoints share; subclasses say what their prompts and limits are."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = _limit_field("max_tokens")
    temperature: float = _sampling_field("temperature")
    top_p: float = _sampling_field("top_p")
    top_k: int = _sampling_field("top_k")
    min_p: float = _sampling_field("min_p")
    presence_penalty: float = _sampling_field("presence_penalty")
    frequency_penalty: float = _sampling_field("frequency_penalty")
    repetition_penalty: float = _sampling_field("repetition_penalty")
    seed: int | None = _sampling_field("seed")
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = _DEFAULTS.ignore_eos
    min_tokens: int = _sampling_field("min_tokens")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        """The output limit asked for; None: as many as fit the context."""
        raise NotImplementedError

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token asked for; None: no logprobs."""
        raise NotImplementedError

    def prompts(self, tokenizer: ModelTokenizer) -> list[Prompt]:
        """The request's prompts, tokenized; raises ApiError for what cannot be served."""
        raise NotImplementedError

    def sampling(self, max_tokens: int, seed_offset: int) -> SamplingOptions:
        """The options of one choice (its seed offset by its index); raises ApiError (400) for
        an option engine.protocol.check_sampling refuses."""
        seed = None if self.seed is None else self.seed + seed_offset
        options = SamplingOptions(
            max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens), temperature=self.temperature,
            top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=seed, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=self.num_logprobs,
        )
        try:
            check_sampling(options)
        except SamplingError as exc:
            raise from_sampling(exc) from exc
        return options


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = _sampling_field("logprobs")
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
        elif not prompt or any((isinstance(p, (str, list)) and not p) for p in prompt):
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> None:
        if suffix is not None:
            raise ValueError("suffix (insertion) is not supported")
        return None

    @property
    def requested_max_tokens(self) -> int:
        return _DEFAULTS.max_tokens if self.max_tokens is None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self, tokenizer: ModelTokenizer) -> list[Prompt]:
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
        if isinstance(self.prompt, str):
            texts_or_ids = [self.prompt]
        elif all(isinstance(p, int) for p in self.prompt):
            texts_or_ids = [list(self.prompt)]
        else:
            texts_or_ids = list(self.prompt)
        return [Prompt(tokenizer.encode(p), p) if isinstance(p, str) else Prompt(list(p)) for p in texts_or_ids]


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _limit_field("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = _sampling_field("logprobs")
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def prompts(self, tokenizer: ModelTokenizer) -> list[Prompt]:
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        try:
            return [Prompt(tokenizer.apply_chat_template(messages, self.add_generation_prompt))]
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from exc


def parse_body(raw: bytes, model: type[GenerationRequest]) -> GenerationRequest:
    """The request body as model; raises ApiError (400) naming what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from exc
