"""OpenAI request bodies, validated with their documented ranges (pydantic, as FastAPI uses)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.protocol import SamplingOptions

MAX_LOGPROBS = 20


# NOTE: strict: "10" is not a number and "yes" not a boolean, as at OpenAI (JSON gives the
# real types; lax mode would quietly coerce them).
_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError("stop_token_ids must be non-negative")
        return ids

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, logprobs: int | None, seed_offset: int) -> SamplingOptions:
        seed = None if self.seed is None else self.seed + seed_offset
        return SamplingOptions(
            max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens), temperature=self.temperature,
            top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=seed, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
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

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0
