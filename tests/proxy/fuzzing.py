"""Fuzzing the proxy's HTTP API: Schemathesis cases (positive and negative) drawn from the
proxy's own /openapi.json, and a hand-written list of hostile bodies, each sent with a timeout
and its answer checked: never a 5xx, never a hang, every error an OpenAI error object. Shared
by tests/proxy/test_fuzz.py (a short budget) and benchmarks/fuzz.py (a long one)."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.transport import STREAM_CUT_SHORT_ATTRIBUTE

from proxy.limits import MAX_JSON_DEPTH
from proxy.schemas import MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_STRINGS

BIG = 2**70
_ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class FuzzReport:
    """Answers counted by (source, status) — source: "positive", "negative" or "hostile" — and
    the problems found (each a line naming the case)."""

    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    num_cases: int = 0
    elapsed_s: float = 0.0
    # Negative cases (outside the schema) answered 200: not failures (the schema may be stricter
    # than the server, e.g. a body that is JSON under another content type), but worth a look.
    accepted_negative: list[str] = field(default_factory=list)

    def add(self, source: str, status: int | str, problems: list[str], what: str) -> None:
        self.num_cases += 1
        self.counts[(source, status)] += 1
        self.problems.extend(f"{source} {what}: {p}" for p in problems)

    def by_status(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for (source, status), num in sorted(self.counts.items(), key=lambda item: (item[0][0], str(item[0][1]))):
            table.setdefault(source, {})[str(status)] = num
        return table


def check_answer(status: int, headers, content: bytes) -> list[str]:
    """What is wrong with one answer: a 5xx, an error that is not an OpenAI error object, a 429
    without Retry-After, a 200 that is not JSON or a complete SSE stream."""
    if status >= 500:
        return [f"server error {status}: {content[:300]!r}"]
    if status >= 400:
        return _check_error(status, headers, content)
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len(b"data: "):] for line in content.splitlines() if line.startswith(b"data: ")]
        return [] if events and events[-1] == b"[DONE]" else [f"stream did not end with [DONE]: {content[-300:]!r}"]
    try:
        json.loads(content)
    except ValueError:
        return [f"{status} body is not JSON: {content[:300]!r}"]
    return []


def _check_error(status: int, headers, content: bytes) -> list[str]:
    try:
        error = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return [f"{status} body is not an OpenAI error object: {content[:300]!r}"]
    if not isinstance(error, dict) or set(error) != _ERROR_KEYS or not isinstance(error["message"], str):
        return [f"{status} error object malformed: {content[:300]!r}"]
    if status == 429 and not headers.get("retry-after", "").isdigit():
        return ["429 without an integer Retry-After"]
    return []


def fuzz_schema(base_url: str, model: str, max_examples: int, budget_s: float, timeout_s: float = 20.0,
                random_seed: int = 0, report: FuzzReport | None = None) -> FuzzReport:
    """Send Schemathesis cases for every POST endpoint of base_url's /openapi.json, half
    positive, half negative, until max_examples per mode or budget_s is spent. Three in four
    bodies use the served model's name, so cases get past the model check."""
    report = report or FuzzReport()
    document = httpx.get(base_url + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    # NOTE: Schemathesis (4.32.5) stops reading an event stream after 20 events by default and
    # closes it, which cut long answers (n=19) short of their [DONE]; read every event here, so
    # only its per-request timeout (a hang) cuts a stream.
    schema.config.max_stream_events = _MAX_STREAM_EVENTS
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().method.upper() == "POST"]
    session = requests.Session()
    deadline = time.monotonic() + budget_s
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        mode_deadline = min(deadline, time.monotonic() + budget_s / 2)
        cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations])
        _fuzz_mode(cases, mode.value, mode_deadline, max_examples, random_seed,
                   lambda case, use_model, source: _send_case(session, base_url, case, source,
                                                              model if use_model else None, timeout_s, report))
    return report


_MAX_STREAM_EVENTS = 1_000_000


class _OutOfTime(Exception):
    """Ends the drawing of cases at the deadline."""


def _fuzz_mode(cases, source: str, deadline: float, max_examples: int, random_seed: int, send) -> None:
    """Draw up to max_examples cases (with a coin for using the served model's name) and send
    each, until deadline (time.monotonic()). Problems are recorded, never raised, so Hypothesis
    does not shrink; the deadline is the one exception, and ends the run."""

    @seed(random_seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(case=cases, use_model=st.integers(0, 3))
    def run(case, use_model: int) -> None:
        if time.monotonic() > deadline:
            raise _OutOfTime
        send(case, use_model, source)

    with contextlib.suppress(_OutOfTime):
        run()


def _send_case(session: requests.Session, base_url: str, case, source: str, model: str | None, timeout_s: float,
               report: FuzzReport) -> None:
    # NOTE: a negative case keeps what made it negative: only a model name already a string is
    # replaced there (a missing or mistyped one may be the point).
    is_named = source == "positive" or isinstance(case.body, dict) and isinstance(case.body.get("model"), str)
    if model is not None and isinstance(case.body, dict) and is_named:
        case.body["model"] = model
    what = f"{case.operation.path} {_short(case.body)}"
    try:
        response = case.call(base_url=base_url, session=session, timeout=timeout_s)
    except requests.Timeout:
        report.add(source, "timeout", [f"no answer within {timeout_s} s"], what)
        return
    except requests.RequestException as exc:
        report.add(source, "connection error", [f"{type(exc).__name__}: {exc}"], what)
        return
    headers = {name.lower(): values[0] if isinstance(values, list) else values
               for name, values in response.headers.items()}
    if getattr(response, STREAM_CUT_SHORT_ATTRIBUTE, False):
        report.add(source, "timeout", [f"stream still open after {timeout_s} s (the client stopped reading)"], what)
        return
    report.add(source, response.status_code, check_answer(response.status_code, headers, response.content), what)
    if source == "negative" and response.status_code < 300:
        report.accepted_negative.append(f"{case.media_type} {headers.get('content-type')} {what}")


def _short(body) -> str:
    text = repr(body)
    return text if len(text) <= 300 else text[:300] + "..."


def hostile_bodies(model: str) -> list[tuple[str, str, bytes | str, str | None]]:
    """(name, path, body, content type): each must get a 4xx."""
    ok = {"model": model, "prompt": "hello", "max_tokens": 3}

    def body(**fields) -> str:
        return json.dumps({**ok, **fields})

    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    deep_schema = json.loads("{\"a\": " * MAX_JSON_DEPTH + "1" + "}" * MAX_JSON_DEPTH)
    cases = [
        ("invalid UTF-8", "/v1/completions", b'{"model": "\xff\xfe", "prompt": "x"}'),
        ("invalid UTF-8 in chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'),
        ("encoded surrogate", "/v1/completions", b'{"model": "m", "prompt": "\xed\xa0\x80"}'),
        ("empty body", "/v1/completions", b""),
        ("whitespace body", "/v1/chat/completions", b"   \n"),
        ("not an object", "/v1/completions", b"[1, 2]"),
        ("null", "/v1/chat/completions", b"null"),
        ("truncated", "/v1/completions", body()[:-5]),
        ("10 MB body", "/v1/completions", body(prompt="x" * (10 << 20))),
        ("nested 100k deep", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
        ("objects nested 100k deep", "/tokenize", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ("nested 100k deep, unclosed", "/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 100_000),
        ("nested too deep in a schema", "/v1/completions", body(response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": deep_schema}})),
        ("guided_json text nested 100k deep", "/v1/completions", body(guided_json="[" * 100_000)),
        ("brackets then a string that never closes, of 120k escaped quotes", "/v1/completions",
         b"[" * 70 + b'"' + b'\\"' * 120_000),
        ("guided_regex groups nested 5,000 deep", "/v1/completions", body(guided_regex="(" * 5000 + "a" + ")" * 5000)),
        ("regex repetition count of 5,000 digits", "/v1/completions", body(guided_regex="a{" + "9" * 5000 + "}")),
        ("schema pattern repetition bounds of 5,000 digits", "/v1/completions", body(response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "string", "pattern": "a{1," + "9" * 5000 + "}"}}})),
        ("schema pattern groups nested 100k deep, unclosed", "/v1/chat/completions", json.dumps({
            **chat, "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "string", "pattern": "(" * 100_000}}}})),
        ("tool call arguments nested 100k deep", "/v1/chat/completions", json.dumps({**chat, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": '{"a":' * 100_000}}]}]})),
        ("NaN", "/v1/completions", body(temperature=0.5).replace("0.5", "NaN")),
        ("Infinity", "/v1/completions", body(top_p=0.5).replace("0.5", "Infinity")),
        ("-Infinity", "/v1/chat/completions",
         json.dumps({**chat, "presence_penalty": 0.5}).replace("0.5", "-Infinity")),
        ("1e999", "/v1/completions", body(temperature=0.5).replace("0.5", "1e999")),
        ("5000-digit integer", "/v1/completions", body(max_tokens=1).replace('"max_tokens": 1', '"max_tokens": '
                                                                             + "9" * 5000)),
        ("max_tokens 2**70", "/v1/completions", body(max_tokens=BIG)),
        ("seed 2**70", "/v1/completions", body(seed=BIG)),
        ("n 2**70", "/v1/chat/completions", json.dumps({**chat, "n": BIG})),
        ("top_k 2**70", "/v1/completions", body(top_k=BIG)),
        ("prompt ids 2**70", "/v1/completions", body(prompt=[BIG])),
        ("stop_token_ids 2**70", "/v1/completions", body(stop_token_ids=[BIG])),
        ("logit_bias key 2**70", "/v1/completions", body(logit_bias={str(BIG): 1})),
        ("logit_bias key of 5000 digits", "/v1/completions", body(logit_bias={"7" * 5000: 1})),
        ("detokenize 2**70", "/detokenize", json.dumps({"tokens": [BIG]})),
        ("negative n", "/v1/completions", body(n=-1)),
        ("negative max_tokens", "/v1/completions", body(max_tokens=-1)),
        ("negative min_tokens", "/v1/completions", body(min_tokens=-3)),
        ("negative logprobs", "/v1/completions", body(logprobs=-1)),
        ("negative top_logprobs", "/v1/chat/completions", json.dumps({**chat, "logprobs": True, "top_logprobs": -2})),
        ("negative token id", "/detokenize", json.dumps({"tokens": [-1]})),
        ("lone surrogate in the prompt", "/v1/completions", body(prompt="a\ud800b")),
        ("lone surrogate in chat", "/v1/chat/completions", json.dumps({**chat, "messages": [
            {"role": "user", "content": "\udfff"}]})),
        ("lone surrogate in a key", "/v1/completions", body(logit_bias={"\udc00": 1})),
        ("lone surrogate to /tokenize", "/tokenize", json.dumps({"prompt": "\ud8ff"})),
        ("too many choices", "/v1/completions", body(prompt=["a"] * (MAX_CHOICES + 1))),
        ("too many stop strings", "/v1/completions", body(stop=["s"] * (MAX_STOP_STRINGS + 1))),
        ("too long stop string", "/v1/completions", body(stop="s" * (MAX_STOP_CHARS + 1))),
        ("stop_token_ids past the vocabulary", "/v1/completions", body(stop_token_ids=[10**7])),
        ("logit_bias past the vocabulary", "/v1/completions", body(logit_bias={"10000000": 1})),
        ("unknown field in an object", "/v1/completions", body(response_format={"type": "text", "frobnicate": 1})),
        ("vLLM field that cannot be honoured", "/v1/completions", body(use_beam_search=True)),
    ]
    typed = [(name, path, content, "application/json") for name, path, content in cases]
    return typed + [
        ("form body", "/v1/completions", b"model=m&prompt=x", "application/x-www-form-urlencoded"),
        ("multipart body", "/v1/chat/completions",
         b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nb\r\n--x--", "multipart/form-data; boundary=x"),
        ("XML body", "/tokenize", b"<prompt>hi</prompt>", "application/xml"),
        ("binary body", "/detokenize", bytes(range(256)), "application/octet-stream"),
        ("no content type, empty", "/v1/completions", b"", None),
    ]


def send_hostile(base_url: str, model: str, timeout_s: float = 20.0, report: FuzzReport | None = None) -> FuzzReport:
    """Send every hostile body; each must be answered with a 4xx OpenAI error in time."""
    report = report or FuzzReport()
    with httpx.Client(timeout=timeout_s) as client:
        for name, path, content, content_type in hostile_bodies(model):
            headers = {"Content-Type": content_type} if content_type else {}
            try:
                response = client.post(base_url + path, content=content, headers=headers)
            except httpx.TimeoutException:
                report.add("hostile", "timeout", [f"no answer within {timeout_s} s"], name)
                continue
            problems = check_answer(response.status_code, response.headers, response.content)
            if not 400 <= response.status_code < 500:
                problems.append(f"expected a 4xx, got {response.status_code}")
            report.add("hostile", response.status_code, problems, name)
    return report


def check_still_serving(base_url: str, model: str) -> list[str]:
    """A normal request after the fuzzing: a 200 with 4 tokens, streamed and not."""
    body = {"model": model, "prompt": "hello world", "max_tokens": 4, "ignore_eos": True}
    problems = []
    full = httpx.post(base_url + "/v1/completions", json=body, timeout=20)
    if full.status_code != 200 or full.json()["usage"]["completion_tokens"] != 4:
        problems.append(f"normal request: {full.status_code} {full.text[:300]}")
    streamed = httpx.post(base_url + "/v1/completions", json={**body, "stream": True}, timeout=20)
    problems += [f"normal streamed request: {p}" for p in check_answer(streamed.status_code, streamed.headers,
                                                                         streamed.content)]
    return problems
