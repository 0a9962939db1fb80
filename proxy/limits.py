"""Bounds on the JSON a client sends, before any of it is trusted (UTF-8, nesting depth, no NaN
or Infinity, no lone surrogates); each breach is a 400 with an OpenAI error body. The body's
size, pace and uploads at once are proxy.uploads'."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from proxy.errors import ApiError

# NOTE: deep enough for any real JSON schema or tool definition (they rarely pass 20); the
# stdlib parser recurses once per level and pydantic, the chat template and json.dumps walk the
# same structures recursively, so this bound keeps all of them far from the recursion limit.
MAX_JSON_DEPTH = 64
# \uD800-\uDFFF escapes: a lone one becomes a lone surrogate, which no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A JSON string, escapes included: its brackets are text, not nesting. NOTE: the closing quote is
# optional, so a string that never closes takes the rest of the body in one match (the parser
# nests no deeper past it); required, each later quote would scan to the end again (quadratic).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def parse_json(raw: bytes) -> Any:
    """The body as JSON: strict UTF-8, nested at most MAX_JSON_DEPTH deep, numbers finite (no
    NaN or Infinity, as literals or overflowing), no lone surrogates (escapes \\uD800-\\uDFFF
    not in a pair). Raises ApiError (400). Costs a pass over the bytes only for bodies with many
    brackets, and one over the parsed values only for bodies with surrogate escapes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8: {exc}") from exc
    # NOTE: before the parser, not after: the stdlib parser recurses once per level, and one
    # that reaches the recursion limit runs whatever the garbage collector finalizes then at that
    # depth too, where a finalizer's first call fails.
    if too_deep(raw):
        raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except ValueError as exc:  # JSONDecodeError, a refused number, an integer of over 4,300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(raw):
        _check_no_lone_surrogates(data)
    return data


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:40]} is out of range (not a finite double)")
    return value


def loads(text: str) -> Any:
    """json.loads for JSON text found inside a request or a model's output (tool call arguments,
    a schema given as text): a ValueError, before any parsing, for text nested more than
    MAX_JSON_DEPTH deep, as for anything else that is not valid JSON."""
    if _many_brackets(text) and _deepest(text.encode("utf-8", "surrogatepass")) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
    return json.loads(text)


def too_deep(raw: bytes) -> bool:
    """Whether arrays and objects in raw nest more than MAX_JSON_DEPTH deep (see _deepest)."""
    return _many_brackets(raw) and _deepest(raw) > MAX_JSON_DEPTH


def _many_brackets(text: str | bytes) -> bool:
    """Whether text opens more than MAX_JSON_DEPTH arrays and objects (strings included): short of
    that it cannot nest deeper, and nothing is scanned."""
    opening = ("[", "{") if isinstance(text, str) else (b"[", b"{")
    return text.count(opening[0]) + text.count(opening[1]) > MAX_JSON_DEPTH


def _deepest(raw: bytes) -> int:
    """How deep arrays and objects nest in the body, brackets inside strings left out; exact for
    valid JSON. One pass in C over the bytes, no recursion."""
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_A_BRACKET), dtype=np.uint8)
    if not brackets.size:
        return 0
    # "[" 0x5B and "{" 0x7B have bit 1 set, "]" 0x5D and "}" 0x7D do not: +1 opens, -1 closes.
    return int(np.cumsum((brackets & 2).astype(np.int8) - 1, dtype=np.int32).max())


def _check_no_lone_surrogates(data: Any) -> None:
    """Raises ApiError (400) naming the first string (key or value) holding a lone surrogate."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                _check_string(key)
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"request body holds a lone surrogate (\\u{ord(text[exc.start]):04x}) in a string: "
                            "not valid Unicode text") from exc
