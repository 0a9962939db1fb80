"""How request bodies take their fields. Strictly typed, unknown fields refused (STRICT), but at
the top level of a completion body (GENERATION): there vLLM's and OpenAI's fields whose loss
would change the answer are refused with a 400 naming them (unless their value asks for nothing),
and every other unknown field is ignored, as vLLM ignores them, and named to the client in the
Pdserve-Ignored-Fields header and in a WARNING line once per distinct set (or refused with
--strict-fields)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from pydantic import ConfigDict

from proxy.errors import ApiError

logger = logging.getLogger(__name__)

# NOTE: strict: "10" is not a number and "yes" not a boolean, as at OpenAI (JSON gives the
# real types; lax mode would quietly coerce them). A float field refuses infinity (a number
# literal past the double range parses as one). Unknown fields are refused: inside an object (a
# message, response_format, stream_options) one is a mistake whose meaning would be lost.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
# A completion body's top level: as STRICT, but unknown fields are dropped, as vLLM drops them
# (clients written for other servers send their own); proxy.schemas.parse_data first names them
# (undeclared_fields) or refuses them (--strict-fields).
GENERATION = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

IGNORED_FIELDS_HEADER = "pdserve-ignored-fields"
MAX_NAMED_FIELDS = 32  # names in the header and the log line; past it, "..." (the log gives the count)
MAX_NAME_CHARS = 64  # per name in the header and the log line
MAX_REMEMBERED_SETS = 1024  # distinct field sets already logged (oldest forgotten first)
MAX_LINES_PER_WINDOW = 10  # WARNING lines for new field sets per window; the rest are counted
WINDOW_S = 60.0

_GRAMMARS = "the nodes' grammars take JSON schemas, regular expressions, choices and EBNF grammars"
# Undeclared fields that are refused, as (values that ask for nothing, why it is refused). A
# value among the first is dropped without a word (vLLM clients send every field's default);
# any other is a 400 naming the field: ignoring it would change the answer.
REFUSED_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "use_beam_search": ((None, False), "beam search is not supported"),
    "truncate_prompt_tokens": ((None,), "prompt truncation is not supported: send the prompt to use"),
    "allowed_token_ids": ((None,), "restricting the vocabulary is not supported"),
    "bad_words": ((None, []), "banning words is not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "prompt_logprobs": ((None,), "not supported: use echo with logprobs (completions)"),
    "return_token_ids": ((None, False), "returning token ids is not supported"),
    "cache_salt": ((None,), "a salted prefix cache is not supported: every request shares it"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported: send text or token ids"),
    "structural_tag": ((None,), f"structural tags are not supported: {_GRAMMARS}"),
    "guided_whitespace_pattern": ((None,), "a whitespace pattern for JSON is not supported"),
    # Chat only (completions declare echo): vLLM's echo of the last message.
    "echo": ((None, False), "echoing the last message is not supported on chat completions"),
    # OpenAI's deprecated function calling, replaced by tools.
    "functions": ((None, []), "not supported (deprecated by OpenAI): send tools"),
    "function_call": ((None, "none"), "not supported (deprecated by OpenAI): send tool_choice"),
}


def undeclared_fields(data: dict, declared: Iterable[str]) -> list[str]:
    """The keys of data (in body order) that are not declared, nor refused fields whose value
    asks for nothing. Raises ApiError (400) for the first refused field whose value asks for
    something (see REFUSED_FIELDS)."""
    known = set(declared)
    undeclared = []
    for name, value in data.items():
        if name in known:
            continue
        refused = REFUSED_FIELDS.get(name)
        if refused is None:
            undeclared.append(name)
        elif not _asks_nothing(value, refused[0]):
            raise ApiError(400, f"{name}: {refused[1]}", name)
    return undeclared


def _asks_nothing(value: object, inert: tuple[object, ...]) -> bool:
    # NOTE: by type too: 0 == False in Python, but 0 is not a boolean here.
    return any(value == other and type(value) is type(other) for other in inert)


def unknown_fields_error(names: Sequence[str]) -> ApiError:
    """The 400 for fields this server does not know, naming them all (param: the first)."""
    return ApiError(400, f"unsupported field{'s' if len(names) > 1 else ''} {_listed(names)}: not known to this "
                         "server (it refuses fields rather than ignore them)", names[0])


def _listed(names: Sequence[str]) -> str:
    """names for a message or a log line: quoted and escaped (repr), cut, at most MAX_NAMED_FIELDS."""
    listed = ", ".join(repr(name[:MAX_NAME_CHARS]) for name in names[:MAX_NAMED_FIELDS])
    return listed + (f" and {len(names) - MAX_NAMED_FIELDS} more" if len(names) > MAX_NAMED_FIELDS else "")


def ignored_fields_header(names: Sequence[str]) -> dict[str, str]:
    """The response header naming the ignored fields ({} for none): comma separated, each
    cut to MAX_NAME_CHARS, with anything outside printable ASCII (and commas) escaped."""
    if not names:
        return {}
    listed = [ascii(name[:MAX_NAME_CHARS])[1:-1].replace(",", "\\x2c") for name in names[:MAX_NAMED_FIELDS]]
    if len(names) > MAX_NAMED_FIELDS:
        listed.append("...")
    return {IGNORED_FIELDS_HEADER: ", ".join(listed)}


class IgnoredFieldsLog:
    """Logs a WARNING line naming the ignored fields of a request, once per (endpoint, field
    set): a set seen before (among the last MAX_REMEMBERED_SETS) is not logged again, and at
    most MAX_LINES_PER_WINDOW new sets are logged per WINDOW_S, the next line counting those
    left out. So a client cannot flood the log, however it varies its fields. One per app; on
    the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logged: OrderedDict[tuple[str, frozenset[str]], None] = OrderedDict()
        self._window_start_s = clock()
        self._num_lines = 0
        self._num_left_out = 0

    def note(self, endpoint: str, names: Sequence[str]) -> None:
        """Log names (the fields a request to endpoint had ignored) unless seen or over budget."""
        if not names:
            return
        # NOTE: the names as logged (cut, at most MAX_NAMED_FIELDS): a set remembered stays small.
        key = (endpoint, frozenset(name[:MAX_NAME_CHARS] for name in names[:MAX_NAMED_FIELDS]))
        if key in self._logged:
            self._logged.move_to_end(key)
            return
        now_s = self._clock()
        if now_s - self._window_start_s >= WINDOW_S:
            self._window_start_s, self._num_lines = now_s, 0
        if self._num_lines >= MAX_LINES_PER_WINDOW:
            self._num_left_out += 1  # NOTE: not remembered: logged when a later window has room
            return
        self._num_lines += 1
        self._remember(key)
        left_out = (f" ({self._num_left_out} requests with other new field sets were not logged)"
                    if self._num_left_out else "")
        self._num_left_out = 0
        logger.warning("%s: ignored request field%s not known to this server: %s (--strict-fields refuses "
                       "them; each set is logged once)%s", endpoint, "s" if len(names) > 1 else "", _listed(names),
                       left_out)

    def _remember(self, key: tuple[str, frozenset[str]]) -> None:
        self._logged[key] = None
        if len(self._logged) > MAX_REMEMBERED_SETS:
            self._logged.popitem(last=False)
