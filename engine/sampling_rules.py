"""The ranges a request's sampling options and structured-output spec must be in: the limits and
the checks, run alike by the proxy (a 400 naming the field) and by the engine (SamplingError).
Torch-free, as engine.protocol, whose SamplingOptions and StructuredOutput they check."""

from __future__ import annotations

import math

import msgspec

from engine.protocol import STRUCTURED_FIELDS, SamplingOptions, StructuredKind, StructuredOutput

MAX_LOGPROBS = 20  # top alternatives per token a request may ask for
MAX_SEED = 2**63 - 1  # seeds fit a signed 64-bit generator seed
MAX_LOGIT_BIAS = 100.0  # |bias| per token, OpenAI's range
MAX_JSON_SCHEMA_BYTES = 1 << 16  # a schema is compiled on the node's loop: keep it bounded
# The other grammars' bounds (a regex's repetitions are budgeted by engine.schema_budget). NOTE:
# measured on a 49k vocab: 256 choices of 64 characters, or a 15 KB EBNF of 430 rules, compile in
# under 0.1 s.
MAX_REGEX_BYTES = 1 << 14
MAX_GRAMMAR_BYTES = 1 << 15
MAX_NUM_GRAMMAR_CHOICES = 256
MAX_GRAMMAR_CHOICES_BYTES = 1 << 14  # all choices together, UTF-8
MAX_INT64 = 2**63 - 1  # every integer option fits a signed 64-bit tensor element
MAX_TOKEN_ID = 2**31 - 1  # token ids (stop_token_ids, logit_bias keys) fit int32; the engine checks its vocab
MAX_STOP_TOKEN_IDS = 1024  # each is compared per sampled token: keep the list short


# (field, lowest, highest, is the lowest itself allowed): None where a side is open.
SAMPLING_RANGES: tuple[tuple[str, float | None, float | None, bool], ...] = (
    ("max_tokens", 1, MAX_INT64, True),
    ("min_tokens", 0, MAX_INT64, True),
    ("temperature", 0.0, 2.0, True),
    ("top_p", 0.0, 1.0, False),
    ("top_k", -1, MAX_INT64, True),  # values past the vocab size mean "off"
    ("min_p", 0.0, 1.0, True),
    ("presence_penalty", -2.0, 2.0, True),
    ("frequency_penalty", -2.0, 2.0, True),
    ("repetition_penalty", 0.0, 2.0, False),
    ("seed", 0, MAX_SEED, True),
    ("logprobs", 0, MAX_LOGPROBS, True),
    ("prompt_logprobs", 0, MAX_LOGPROBS, True),
)


class SamplingError(ValueError):
    """A sampling option out of its range; param names the field (the OpenAI error's param)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_sampling(options: SamplingOptions) -> None:
    """Raise SamplingError naming the first field out of its range (see SAMPLING_RANGES; floats
    must also be finite, integers within a signed 64-bit value)."""
    for name, low, high, is_low_allowed in SAMPLING_RANGES:
        value = getattr(options, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise SamplingError(name, f"{name} must be a finite number, got {value}")
        too_low = low is not None and (value < low or (value == low and not is_low_allowed))
        if too_low or (high is not None and value > high):
            raise SamplingError(name, f"{name} must be in {_range_text(low, high, is_low_allowed)}, got {value}")
    if options.min_tokens > options.max_tokens:
        raise SamplingError("min_tokens", f"min_tokens ({options.min_tokens}) must be <= max_tokens "
                                          f"({options.max_tokens})")
    _check_stop_token_ids(options.stop_token_ids)
    if options.logit_bias is not None:
        _check_logit_bias(options.logit_bias)
    if options.structured is not None:
        check_structured(options.structured)


def _check_stop_token_ids(stop_token_ids: list[int]) -> None:
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingError("stop_token_ids", f"stop_token_ids has {len(stop_token_ids)} ids; the limit is "
                                              f"{MAX_STOP_TOKEN_IDS}")
    bad = [t for t in stop_token_ids if not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise SamplingError("stop_token_ids", f"stop_token_ids must be in [0, {MAX_TOKEN_ID}], got {bad[:5]}")


def _check_logit_bias(logit_bias: dict[int, float]) -> None:
    """Token ids in [0, MAX_TOKEN_ID] (the engine checks them against its vocab), biases in
    [-100, 100]."""
    bad_ids = [t for t in logit_bias if not 0 <= t <= MAX_TOKEN_ID]
    if bad_ids:
        raise SamplingError("logit_bias", f"logit_bias token ids must be in [0, {MAX_TOKEN_ID}], got {bad_ids[:5]}")
    bad = {t: b for t, b in logit_bias.items() if not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS)}
    if bad:
        raise SamplingError("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                          f"{MAX_LOGIT_BIAS:g}], got {dict(list(bad.items())[:5])}")


def check_structured(structured: StructuredOutput) -> None:
    """Raise SamplingError("structured") unless exactly the field of structured's kind is set,
    within its bound (MAX_*_BYTES, MAX_NUM_GRAMMAR_CHOICES), not empty, and json_schema is JSON
    text of an object. Whether the grammar library takes it is the engine's check (it compiles it)."""
    name = STRUCTURED_FIELDS.get(structured.kind)
    extra = [other for other in STRUCTURED_FIELDS.values() if other != name and getattr(structured, other) is not None]
    if extra:
        raise SamplingError("structured", f"structured kind {structured.kind.value} takes no {extra[0]}")
    if name is None:
        return
    value = getattr(structured, name)
    if not value:
        raise SamplingError("structured", f"structured kind {structured.kind.value} needs a non-empty "
                                          f"structured.{name}")
    if structured.kind is StructuredKind.CHOICE:
        _check_choices(value)
        return
    limit = {"json_schema": MAX_JSON_SCHEMA_BYTES, "regex": MAX_REGEX_BYTES, "grammar": MAX_GRAMMAR_BYTES}[name]
    if len(value.encode()) > limit:
        raise SamplingError("structured", f"structured.{name} has {len(value.encode())} bytes; the limit is {limit}")
    if structured.kind is StructuredKind.JSON_SCHEMA:
        _check_json_object(value)


def _check_choices(choices: tuple[str, ...]) -> None:
    num_bytes = sum(len(choice.encode()) for choice in choices)
    if len(choices) > MAX_NUM_GRAMMAR_CHOICES or num_bytes > MAX_GRAMMAR_CHOICES_BYTES:
        raise SamplingError("structured", f"structured.choices has {len(choices)} choices of {num_bytes} bytes "
                                          f"together; the limits are {MAX_NUM_GRAMMAR_CHOICES} choices and "
                                          f"{MAX_GRAMMAR_CHOICES_BYTES} bytes")


def _check_json_object(schema: str) -> None:
    try:
        decoded = msgspec.json.decode(schema)
    except msgspec.DecodeError as exc:
        raise SamplingError("structured", f"structured.json_schema is not valid JSON: {exc}") from None
    if not isinstance(decoded, dict):
        raise SamplingError("structured", f"structured.json_schema must be a JSON object, got {type(decoded).__name__}")


def _range_text(low, high, is_low_allowed: bool) -> str:
    opening = "[" if is_low_allowed else "("
    return f"{opening}{low}, {'inf)' if high is None else f'{high}]'}"
