"""The Jinja sandbox chat templates render in, built as transformers builds it (the same
filters, globals, extensions and undefined handling, so the same text comes out), and the
bounds that keep an untrusted template from hanging or swamping the proxy."""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.errors import ChatTemplateError

# NOTE: the bounds. A rendered prompt must fit the context after tokenizing, and a token is
# a few characters (rarely past 16), so 16 Mi characters is far past any real prompt (a 1M-token
# context is ~4 Mi characters) and caps a runaway template's output at 64 MB (4-byte
# characters); one repeating a 10 kB message reaches it in ~170 ms, one writing short pieces
# meets the deadline first (100k pieces take ~50 ms).
MAX_RENDERED_CHARS = 16 * 2**20
# `*` (str/list repetition) and `**` are the sandbox's intercepted operators; results past
# these sizes are refused before they are built (`'x' * 10**9`, `10 ** 10**9`).
MAX_REPEATED_ITEMS = MAX_RENDERED_CHARS
MAX_POWER_BITS = 2**16
# Errors a template can raise on its inputs (or by raise_exception): each is a 400 naming it.
_TEMPLATE_FAILURES = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                      RecursionError, MemoryError)


class _Interrupted(BaseException):
    """Raised inside a rendering thread past its deadline; a BaseException, so the template's
    runtime (which catches Exception in places) cannot swallow it."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's part with it
    (for training masks); rendering a prompt shows the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class _DictMaker:
    """The template's `dict`: builds dicts, but is not the dict type (no class attributes to walk)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The template's `namespace`, refusing underscore names (no reach into CPython internals)."""

    def __init__(*args, **kwargs) -> None:  # jinja's signature trick: a `self=` attribute still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates may not store underscore-prefixed attributes on a namespace: {name!r}")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: no HTML escaping, non-ASCII kept, json.dumps' options exposed."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment, plus size checks on the operators the sandbox intercepts."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_repetition(left, right)
        elif operator == "**":
            _check_power(left, right)
        return super().call_binop(context, operator, left, right)


def _check_repetition(left: Any, right: Any) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_REPEATED_ITEMS:
            raise SecurityError(f"chat template builds a sequence of {len(seq) * times} items "
                                f"(at most {MAX_REPEATED_ITEMS})")


def _check_power(base: Any, exponent: Any) -> None:
    is_ints = isinstance(base, int) and isinstance(exponent, int)
    if is_ints and abs(base) > 1 and exponent > 0 and base.bit_length() * exponent > MAX_POWER_BITS:
        raise SecurityError(f"chat template computes {base} ** {exponent} (more than {MAX_POWER_BITS} bits)")


def new_environment() -> jinja2.Environment:
    """The environment transformers renders chat templates in: trim_blocks, lstrip_blocks,
    loop controls, {% generation %}, tojson without escaping, raise_exception, strftime_now,
    and its safe dict and namespace."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _Namespace
    return env


def compile_template(env: jinja2.Environment, source: str) -> jinja2.Template:
    """Raises ChatTemplateError naming the syntax error and its line."""
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error on line {exc.lineno}: {exc.message}") from exc


class BoundedRenderer:
    """Renders templates within a wall-clock deadline and MAX_RENDERED_CHARS of output.

    The deadline covers every Python step of the template (loops with empty bodies included):
    a watchdog thread raises _Interrupted inside the rendering thread when it passes. What it
    cannot stop is a single C-level call that allocates in one go from the template's inputs
    (e.g. `str.replace` with an empty needle on two long messages); the operators that build
    sizes from literals (`*`, `**`) are checked, and `range` is the sandbox's (100,000 items)."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._watchdog = _Watchdog()

    def render(self, template: jinja2.Template, variables: dict[str, Any]) -> str:
        """The rendered text; raises ChatTemplateError for whatever the template raised, for
        passing the deadline and for output past MAX_RENDERED_CHARS. Blocks the calling thread
        for up to timeout_s (run it off the event loop)."""
        try:
            with self._watchdog.deadline(self.timeout_s):
                return _collect(template.generate(**variables))
        except _Interrupted:
            raise ChatTemplateError(f"chat template did not finish within {self.timeout_s:g} s") from None
        except ChatTemplateError:
            raise  # the output cap
        except _TEMPLATE_FAILURES as exc:  # the template's own failure on these inputs
            raise ChatTemplateError(f"chat template error: {_describe(exc)}") from exc


def _collect(chunks: Iterator[str]) -> str:
    pieces, num_chars = [], 0
    for chunk in chunks:
        num_chars += len(chunk)
        if num_chars > MAX_RENDERED_CHARS:
            raise ChatTemplateError(f"chat template output passed {MAX_RENDERED_CHARS} characters")
        pieces.append(chunk)
    return "".join(pieces)


def _describe(exc: BaseException) -> str:
    if type(exc) is jinja2.TemplateError:
        return str(exc)  # raise_exception(message): the template's own words
    return f"{type(exc).__name__}: {exc}"


class _Watchdog:
    """One daemon thread (started on first use) that interrupts threads past their deadline."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._deadlines: dict[int, float] = {}  # thread ident -> time.monotonic() deadline
        self._thread: threading.Thread | None = None

    @contextmanager
    def deadline(self, timeout_s: float):
        """Within the block, the calling thread gets _Interrupted once timeout_s has passed.
        After the block nothing is pending for the thread (an interrupt raised but not yet
        delivered is withdrawn), so pool threads are safe to reuse."""
        thread_id = threading.get_ident()
        with self._condition:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chat-template-watchdog", daemon=True)
                self._thread.start()
            self._deadlines[thread_id] = time.monotonic() + timeout_s
            self._condition.notify()
        try:
            yield
        finally:
            with self._condition:
                if self._deadlines.pop(thread_id, None) is None:
                    _set_async_exception(thread_id, None)  # fired: withdraw it if not delivered yet

    def _run(self) -> None:
        with self._condition:
            while True:
                now = time.monotonic()
                for thread_id in [t for t, deadline in self._deadlines.items() if deadline <= now]:
                    del self._deadlines[thread_id]
                    _set_async_exception(thread_id, _Interrupted)
                next_deadline = min(self._deadlines.values(), default=None)
                self._condition.wait(None if next_deadline is None else next_deadline - now)


def _set_async_exception(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise exc_type in thread thread_id at its next bytecode boundary (None: withdraw one
    pending). CPython's PyThreadState_SetAsyncExc, the one way to stop a Python loop in another
    thread; pure-Python steps are the only ones a template takes."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)
