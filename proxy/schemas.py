"""Request bodies (pydantic, strictly typed) of /v1/completions, /tokenize and /detokenize, the
fields both completion endpoints share (response_format, logit_bias and vLLM's structured output
fields among them), and the prompts and sampling options they ask for; every sampling default
comes from engine.protocol, every range from engine.sampling_rules. Unknown fields are refused,
but at the top level of a completion body (see proxy.field_policy). Chat bodies are in
proxy.chat_schemas."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from engine.protocol import SamplingOptions, StructuredKind, StructuredOutput
from engine.sampling_rules import SAMPLING_RANGES, SamplingError, check_sampling, check_structured
from engine.schema_budget import SchemaRefused, SchemaTooCostly, check_pattern, check_schema
from proxy.errors import ApiError, field_path, from_sampling, from_validation
from proxy.field_policy import GENERATION, STRICT, undeclared_fields, unknown_fields_error
from proxy.grammar_fields import ResponseFormat, StructuredOutputsSpec, schema_object
from proxy.limits import parse_json
from proxy.tokenizer import ModelTokenizer, TextOptions

_Body = TypeVar("_Body", bound=BaseModel)

MAX_N = 64  # choices per prompt a request may ask for
MAX_CHOICES = 256  # choices (prompts x n) one request may ask for: each is a request on the nodes
MAX_STOP_STRINGS = 64  # each is searched for in every token's text
MAX_STOP_CHARS = 1024  # per stop string: the longest is held back from the stream while it may begin
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: engine.sampling_rules.MAX_TOKEN_ID has 10 digits

_DEFAULTS = SamplingOptions()
_RANGES = {name: (low, high, is_low_allowed) for name, low, high, is_low_allowed in SAMPLING_RANGES}


def sampling_field(option: str) -> Any:
    """A pydantic Field with the sampling option's default (engine.protocol) and range
    (engine.sampling_rules): out-of-range values fail validation naming the request field."""
    return Field(default=getattr(_DEFAULTS, option), **_bounds(option))


def limit_field(option: str) -> Any:
    """As sampling_field, but None (the default) means "not set": the proxy picks the value."""
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
    model_config = STRICT

    include_usage: bool = False
    # Ignored, meaningless here: OpenAI pads chunks with random text to hide their lengths.
    include_obfuscation: bool | None = None


class GenerationRequest(BaseModel):
    """The fields both completion endpoints share; subclasses say what their prompts and limits
    are. Fields OpenAI clients send that mean nothing here are accepted and ignored (each says
    why); fields accepted but not honoured (yet) are refused by check_supported(). Undeclared
    fields are dropped (see parse_data): ignored_fields names them."""

    model_config = GENERATION

    model: str
    max_tokens: int | None = limit_field("max_tokens")
    temperature: float = sampling_field("temperature")
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k")
    min_p: float = sampling_field("min_p")
    presence_penalty: float = sampling_field("presence_penalty")
    frequency_penalty: float = sampling_field("frequency_penalty")
    repetition_penalty: float = sampling_field("repetition_penalty")
    seed: int | None = sampling_field("seed")
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # only best_of == n: one sample per choice
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # count, range: engine.sampling_rules; vocab: service
    ignore_eos: bool = _DEFAULTS.ignore_eos
    min_tokens: int = sampling_field("min_tokens")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Token ids (decimal strings, as OpenAI's) -> a bias added to the logit; the vocabulary bound
    # is checked by the service (it knows the tokenizer), the values' range by check_sampling.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # ignored: an end-user id for OpenAI's abuse monitoring
    # vLLM's extra fields, with vLLM's meaning and defaults: special tokens in the text, the stop
    # string at the end of the text, and the grammar the output must follow (guided_json: a JSON
    # schema, as response_format json_schema; guided_regex: a regex the whole text matches;
    # guided_choice: the text is exactly one of these; guided_grammar: an EBNF grammar (GBNF,
    # rule "root"); structured_outputs: see StructuredOutputsSpec); return_tokens_as_token_ids:
    # logprobs name each token "token_id:N" instead of its text. spaces_between_special_tokens
    # is accepted and changes nothing: vLLM applies it only to slow tokenizers, and every
    # tokenizer here is a fast one. vLLM's fields not honoured are refused by proxy.field_policy.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool | None = None  # vLLM's default is null
    spaces_between_special_tokens: bool = True
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputsSpec | None = None
    _ignored_fields: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("guided_json")
    @classmethod
    def _schema_object(cls, guided_json: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return schema_object(guided_json, "guided_json")

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        bad = [key[:20] for key in logit_bias or ()
               if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS)]
        if bad:
            raise ValueError(f"keys must be token ids (non-negative decimal integers as strings, at most "
                             f"{MAX_TOKEN_ID_DIGITS} digits), got {bad[:5]}")
        return logit_bias

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        too_long = [len(s) for s in stops if len(s) > MAX_STOP_CHARS]
        if too_long:
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {too_long[0]}")
        return stop

    @property
    def num_prompts(self) -> int:
        """How many prompts the request holds (known before tokenizing)."""
        return 1

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The body's top-level fields this server does not know, dropped (in body order)."""
        return self._ignored_fields

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with int token ids; None when absent or empty."""
        return {int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None

    def grammars_asked(self) -> list[tuple[str, StructuredOutput]]:
        """(the request field, the grammar it asks for) for each field asking for one (a valid
        request has at most one)."""
        asked = []
        if self.guided_json is not None:  # a dict: see _schema_object
            asked.append(("guided_json", StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(self.guided_json))))
        if self.guided_regex is not None:
            asked.append(("guided_regex", StructuredOutput(StructuredKind.REGEX, regex=self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", StructuredOutput(StructuredKind.CHOICE, choices=tuple(self.guided_choice))))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", StructuredOutput(StructuredKind.EBNF, grammar=self.guided_grammar)))
        if self.structured_outputs is not None:
            asked.append((self.structured_outputs.param, self.structured_outputs.structured()))
        structured = None if self.response_format is None else self.response_format.structured()
        if structured is not None:
            asked.append(("response_format", structured))
        return asked

    @property
    def structured_param(self) -> str:
        """The request field that asked for the grammar (the param of its errors)."""
        asked = self.grammars_asked()
        return asked[0][0] if asked else "response_format"

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the output must follow; None: free text."""
        asked = self.grammars_asked()
        return asked[0][1] if asked else None

    @property
    def text_options(self) -> TextOptions:
        """How the choices' token ids become their text."""
        return TextOptions(self.stop_strings, self.skip_special_tokens, self.include_stop_str_in_output,
                           bool(self.return_tokens_as_token_ids))

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token asked for; None: no prompt logprobs."""
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def asked_max_tokens(self) -> tuple[str, int] | None:
        """(the request field, its value) when the request limits its output; None when not."""
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)

    @property
    def default_max_tokens(self) -> int | None:
        """The output limit when none is asked for; None: as many as fit the context."""
        raise NotImplementedError

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token asked for; None: no logprobs."""
        raise NotImplementedError

    def check_supported(self) -> None:
        """Raises ApiError (400) naming a field accepted but not honoured (yet) by this server,
        or asking for more than MAX_CHOICES choices."""
        num_choices = self.num_prompts * self.n
        if num_choices > MAX_CHOICES:
            raise ApiError(400, f"the request asks for {num_choices} choices ({self.num_prompts} prompts x n "
                                f"{self.n}); the limit is {MAX_CHOICES}", "n")
        if self.best_of is not None and self.best_of < self.n:
            raise ApiError(400, f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.best_of is not None and self.best_of > self.n:
            raise ApiError(400, f"best_of > n is not supported (best_of {self.best_of}, n {self.n})", "best_of")
        asked = self.asked_max_tokens
        if asked is not None and self.min_tokens > asked[1]:
            raise ApiError(400, f"min_tokens ({self.min_tokens}) must not exceed {asked[0]} ({asked[1]})",
                           "min_tokens")
        self._check_grammar()

    def _check_grammar(self) -> None:
        """At most one field asks for a grammar, one the nodes enforce, within its bounds
        (engine.sampling_rules) and the grammar budget (engine.schema_budget), as the node checks it
        again before it compiles; whether the grammar library parses it is the node's to say."""
        if self.structured_outputs is not None:
            self.structured_outputs.check_supported()
        params = [param for param, _ in self.grammars_asked()]
        if len(params) > 1:
            raise ApiError(400, f"{params[0]} and {params[1]} both ask for a grammar: give one", params[0])
        structured = self.structured_output()
        if structured is None:
            return
        what = "regex" if structured.kind is StructuredKind.REGEX else "schema"
        try:
            check_structured(structured)
            if structured.json_schema is not None:
                check_schema(json.loads(structured.json_schema))
            if structured.regex is not None:
                check_pattern(structured.regex, "the regex")
        except SchemaTooCostly as exc:
            raise ApiError(400, f"the {what} is too costly to enforce: {exc}", self.structured_param) from None
        except (SchemaRefused, SamplingError) as exc:
            raise ApiError(400, str(exc), self.structured_param) from None

    def prompts(self, tokenizer: ModelTokenizer) -> list[Prompt]:
        """The request's prompts, tokenized; raises ApiError for what cannot be served. May take
        milliseconds (a chat template, a long text): call it off the event loop."""
        raise NotImplementedError

    def sampling(self, max_tokens: int, seed_offset: int) -> SamplingOptions:
        """The options of one choice (its seed offset by its index); raises ApiError (400) for
        an option engine.sampling_rules.check_sampling refuses."""
        seed = None if self.seed is None else self.seed + seed_offset
        options = SamplingOptions(
            max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens), temperature=self.temperature,
            top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=seed, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=self.num_logprobs, logit_bias=self.logit_bias_ids,
            structured=self.structured_output(), prompt_logprobs=self.num_prompt_logprobs,
        )
        try:
            check_sampling(options)
        except SamplingError as exc:
            param = {"structured": self.structured_param, "prompt_logprobs": "logprobs"}.get(exc.param, exc.param)
            raise from_sampling(SamplingError(param, str(exc))) from exc
        return options


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = sampling_field("logprobs")
    suffix: str | None = None
    # vLLM's: text prompts get the special tokens the tokenizer adds (BOS), as tokenizer(text) does.
    add_special_tokens: bool = True

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
    def num_prompts(self) -> int:
        # NOTE: the first item tells a list's kind (validated as one of the union's list types).
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return 1
        return len(self.prompt)

    @property
    def default_max_tokens(self) -> int:
        return _DEFAULTS.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens come back with theirs, as the completion's."""
        return self.logprobs if self.echo else None

    def prompts(self, tokenizer: ModelTokenizer) -> list[Prompt]:
        if isinstance(self.prompt, str):
            texts_or_ids = [self.prompt]
        elif all(isinstance(p, int) for p in self.prompt):
            texts_or_ids = [list(self.prompt)]
        else:
            texts_or_ids = list(self.prompt)
        return [Prompt(tokenizer.encode(p, self.add_special_tokens), p) if isinstance(p, str) else Prompt(list(p))
                for p in texts_or_ids]


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's TokenizeCompletionRequest)."""

    model_config = STRICT

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def prompt_ids(self, tokenizer: ModelTokenizer) -> list[int]:
        return tokenizer.encode(self.prompt, self.add_special_tokens)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids to text, special tokens kept (transformers' decode)."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[_Body], is_strict: bool = True) -> _Body:
    """The request body as model (checked by its check_supported() when it has one); raises
    ApiError (400) naming what is wrong: unknown fields all at once, else the first bad value.
    A completion body (a GenerationRequest) has its unknown top-level fields dropped and named
    in ignored_fields instead, unless is_strict; vLLM's fields it refuses are 400s either way
    (proxy.field_policy)."""
    return parse_data(json_object(raw), model, is_strict)


def parse_data(data: dict, model: type[_Body], is_strict: bool = True) -> _Body:
    """As parse_body, for a body already parsed as JSON."""
    ignored = []
    if issubclass(model, GenerationRequest):
        ignored = undeclared_fields(data, _declared_names(model))
        if ignored and is_strict:
            raise unknown_fields_error(ignored)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from exc
    if ignored:
        body._ignored_fields = tuple(ignored)
    check = getattr(body, "check_supported", None)
    if check is not None:
        check()
    return body


def _declared_names(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def json_object(raw: bytes) -> dict:
    """The request body as a JSON object (see proxy.limits.parse_json); raises ApiError (400)."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def _validation_error(errors: list[dict]) -> ApiError:
    unknown = [field_path(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"]
    return unknown_fields_error(unknown) if unknown else from_validation(errors)
