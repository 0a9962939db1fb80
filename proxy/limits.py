"""Bounds on the JSON a client sends, before any of it is trusted (UTF-8, nesting depth, no NaN
or Infinity, no lone surrogates); each breach is a 400 with an OpenAI error body. The body's
size, pace and uploads at once are proxy.uploads'."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from proxy.errors import ApiError

# NOTE: deep enough for any real JSON schema or tool definition (they rarely pass 20); the
# stdlib parser recurses once per level and pydantic, the chat template and json.dumps walk the
# same structures recursively, so this bound keeps all of them far from the recursion limit.
MAX_JSON_DEPTH = 64
# \uD800-\uDFFF escapes: a lone one becomes a lone surrogate, which no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTAINERS = (dict, list)


def parse_json(raw: bytes) -> Any:
    """The body as JSON: strict UTF-8, nested at most MAX_JSON_DEPTH deep, numbers finite (no
    NaN or Infinity, as literals or overflowing), no lone surrogates (escapes \\uD800-\\uDFFF
    not in a pair). Raises ApiError (400). Costs one pass over the parsed values only for bodies
    with many brackets or surrogate escapes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8: {exc}") from exc
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:  # NOTE: the C parser's own guard, well before the C stack is at risk
        raise _too_deep() from exc
    except ValueError as exc:  # JSONDecodeError, a refused number, an integer of over 4,300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        _check_depth(data)
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


def _too_deep() -> ApiError:
    return ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep")


def _check_depth(data: Any) -> None:
    """Raises ApiError (400) if arrays and objects nest deeper than MAX_JSON_DEPTH; level by
    level, so no recursion."""
    level = [data] if isinstance(data, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, _CONTAINERS)]


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
