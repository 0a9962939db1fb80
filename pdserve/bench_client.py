"""One benchmark request over HTTP: the OpenAI body of a session's turn, sending it (streamed or
not), and timing it the way vLLM's benchmark_serving does; plus the model and /tokenize look-ups.

The requests go through aiohttp, as vLLM's benchmark_serving sends them: the load generator
shares the cores of the servers it measures, so its CPU per streamed chunk counts. On a 2-core
Zen 5, 64 streams of 65 SSE chunks each from a local server, one core: httpx's AsyncClient took
127-142 us of CPU a chunk once its pool held the 64 connections (52 on the first round), aiohttp
12-16 (benchmarks/load_client.py; docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import httpx
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.bench_config import EndpointConfig
from pdserve.bench_datasets import Session, TokenCounter

_ERROR_BODY_CHARS = 300


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; start_s and end_s count from the run's start."""

    request_idx: int
    session_idx: int = 0
    turn_idx: int = 0
    is_ok: bool = False
    start_s: float = 0.0  # sent (after any wait for a concurrency slot)
    queue_s: float = 0.0  # waited for a --max-concurrency slot before start_s
    end_s: float = 0.0  # the last chunk with choices, or the failure
    ttft_s: float | None = None  # to the first chunk with choices
    e2e_s: float | None = None  # to the last chunk with choices (the usage chunk and [DONE] do not count)
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks with choices
    num_prompt_tokens: int | None = None  # usage.prompt_tokens, else the dataset's count if known
    num_output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" or "chunks" (chunks with text, when usage is missing)
    error: str = ""
    text: str = ""  # the answer (multi-turn sessions append it to the next turn's history)

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1); None unless the request succeeded with >= 2 tokens."""
        if not self.is_ok or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_json(self) -> dict:
        keys = ("request_idx", "session_idx", "turn_idx", "is_ok", "start_s", "queue_s", "end_s", "ttft_s",
                "e2e_s", "itl_s", "num_prompt_tokens", "num_output_tokens", "output_tokens_source", "error")
        return {**{k: getattr(self, k) for k in keys}, "tpot_s": self.tpot_s, "num_text_chars": len(self.text)}


def request_body(config: EndpointConfig, model: str, session: Session, turn_idx: int, answers: list[str],
                 is_ignore_eos: bool) -> dict:
    """The JSON body of the session's turn turn_idx, answers being the previous turns' answers."""
    turn = session.turns[turn_idx]
    body: dict = {"model": model, "temperature": config.temperature, "stream": config.is_stream}
    if config.endpoint == "chat":
        body["messages"] = _chat_messages(session, turn_idx, answers)
        body["max_completion_tokens"] = turn.max_tokens
        if config.logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, config.logprobs
    else:
        body["prompt"] = _completion_prompt(session, turn_idx, answers)
        body["max_tokens"] = turn.max_tokens
        if config.logprobs is not None:
            body["logprobs"] = config.logprobs
    if config.is_stream:
        body["stream_options"] = {"include_usage": True}
    if is_ignore_eos:
        body["ignore_eos"] = True
    return body


def _chat_messages(session: Session, turn_idx: int, answers: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for idx in range(turn_idx):
        messages += [{"role": "user", "content": session.turns[idx].prompt},
                     {"role": "assistant", "content": answers[idx]}]
    return messages + [{"role": "user", "content": session.turns[turn_idx].prompt}]


def _completion_prompt(session: Session, turn_idx: int, answers: list[str]) -> str | list[int]:
    """A single turn as given (text or token ids); a conversation as a plain-text transcript."""
    if session.system is None and turn_idx == 0:
        return session.turns[0].prompt
    parts = [f"{session.system}\n\n"] if session.system else []
    for idx in range(turn_idx):
        parts.append(f"User: {session.turns[idx].prompt}\nAssistant: {answers[idx]}\n")
    return "".join(parts) + f"User: {session.turns[turn_idx].prompt}\nAssistant:"


def headers(config: EndpointConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


# NOTE: one SSE line may be long (a chunk with logprobs): aiohttp's line reader refuses lines over
# twice its read buffer (LineTooLong, an HttpProcessingError: the request's error, see send()).
READ_BUFSIZE = 1 << 20


def http_session(limit: int | None, timeout_s: float) -> aiohttp.ClientSession:
    """The load's HTTP session: at most limit connections (None: no limit), kept alive between
    requests; timeout_s bounds connecting and each read (send() bounds the whole request).
    Requests do not follow redirects (as with httpx before): a 3xx is the run's failure to see."""
    connector = aiohttp.TCPConnector(limit=limit or 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=READ_BUFSIZE)


async def send(client: aiohttp.ClientSession, config: EndpointConfig, body: dict, record: RequestRecord,
               run_start: float) -> None:
    """Send body and fill record (never raises for an HTTP or server failure: record.error says it)."""
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    record.start_s = start - run_start
    stream = _StreamState(start)
    sender = _send_streamed if config.is_stream else _send_whole
    try:
        async with asyncio.timeout(config.timeout_s):  # NOTE: not wait_for, which can drop a cancellation on 3.11
            await sender(client, config.base_url + path, body, headers(config), stream)
    except TimeoutError:
        stream.error = f"timed out after {config.timeout_s:g} s"
    except (aiohttp.ClientError, HttpProcessingError, ValueError) as exc:  # JSON and UTF-8 errors are ValueErrors
        stream.error = f"{type(exc).__name__}: {exc}"
    stream.fill(record)
    record.end_s = (stream.last_at or time.perf_counter()) - run_start


async def _send_streamed(client: aiohttp.ClientSession, url: str, body: dict, extra: dict,
                         stream: _StreamState) -> None:
    async with client.post(url, json=body, headers=extra, allow_redirects=False) as response:
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {(await response.read())[:_ERROR_BODY_CHARS]!r}"
            return
        # NOTE: read to the end of the body, past [DONE]: a connection closed mid-body cannot go
        # back to the pool, and a new connection per request would add to the next one's TTFT.
        is_done = False
        async for line in response.content:  # one line at a time, its b"\n" kept
            data = None if is_done else sse_data(line)
            if data is None:
                continue  # blank separators, ": ping" comments, event names
            now = time.perf_counter()
            is_done = data == b"[DONE]"
            if not is_done:
                stream.add(json.loads(data), now)
                is_done = bool(stream.error)


def sse_data(line: bytes) -> bytes | None:
    """The payload of an SSE "data:" line (stripped), None for any other line."""
    return line[5:].strip() if line.startswith(b"data:") else None


async def _send_whole(client: aiohttp.ClientSession, url: str, body: dict, extra: dict, stream: _StreamState) -> None:
    async with client.post(url, json=body, headers=extra, allow_redirects=False) as response:
        content = await response.read()
    now = time.perf_counter()
    if response.status != 200:
        stream.error = f"HTTP {response.status}: {content[:_ERROR_BODY_CHARS]!r}"
        return
    stream.add(json.loads(content), now)


class _StreamState:
    """The chunks of one response as they come: timestamps, usage, text, a mid-stream error."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.itl_s: list[float] = []
        self.usage: dict | None = None
        self.text_parts: list[str] = []
        self.error = ""

    def add(self, chunk: dict, now: float) -> None:
        if chunk.get("error"):
            self.error = f"error event: {json.dumps(chunk['error'])[:_ERROR_BODY_CHARS]}"
        elif chunk.get("choices"):
            # NOTE: as vLLM's bench, any chunk with choices is a token's arrival, even with empty
            # text (a chat role chunk, a finish_reason chunk): TTFT, ITL and E2E all count them.
            if self.first_at is None:
                self.first_at = now
            else:
                self.itl_s.append(now - self.last_at)
            self.last_at = now
            self.text_parts.append(_choice_text(chunk["choices"][0]))
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def fill(self, record: RequestRecord) -> None:
        record.text = "".join(self.text_parts)
        if not self.error and self.first_at is None:
            self.error = "no chunk with choices came (no first token)"
        if self.error:
            record.error = self.error
            return
        record.is_ok, record.ttft_s, record.e2e_s = True, self.first_at - self.start, self.last_at - self.start
        record.itl_s = self.itl_s
        if self.usage and self.usage.get("completion_tokens") is not None:
            record.num_output_tokens, record.output_tokens_source = int(self.usage["completion_tokens"]), "usage"
        else:
            record.num_output_tokens, record.output_tokens_source = sum(1 for part in self.text_parts if part), "chunks"
        if self.usage and self.usage.get("prompt_tokens") is not None:
            record.num_prompt_tokens = int(self.usage["prompt_tokens"])


def _choice_text(choice: dict) -> str:
    """A streamed chunk's text (completions "text", chat "delta.content") or a whole answer's."""
    for holder in (choice, choice.get("delta") or {}, choice.get("message") or {}):
        for key in ("text", "content"):
            if isinstance(holder.get(key), str):
                return holder[key]
    return ""


def first_model(config: EndpointConfig) -> str:
    """The id of the endpoint's first model (GET /v1/models); raises httpx.HTTPError or
    ValueError when the endpoint does not say."""
    response = httpx.get(config.base_url + "/v1/models", headers=headers(config), timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{config.base_url}/v1/models lists no model")
    return models[0]["id"]


@contextlib.contextmanager
def token_counter(config: EndpointConfig, model: str) -> Iterator[tuple[TokenCounter, str]]:
    """A text -> token count function and a line saying how it counts: the endpoint's /tokenize
    (vLLM's: POST {"model", "prompt"} -> {"count"}) when it answers, else characters / 4."""
    with httpx.Client(base_url=config.base_url, headers=headers(config), timeout=30) as client:

        def count_by_server(text: str) -> int:
            response = client.post("/tokenize", json={"model": model, "prompt": text})
            response.raise_for_status()
            data = response.json()
            return int(data["count"]) if "count" in data else len(data["tokens"])

        try:
            count_by_server("hello world")
            has_tokenize = True
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            has_tokenize = False
        if has_tokenize:
            yield count_by_server, f"the endpoint's /tokenize ({config.base_url}/tokenize)"
        else:
            yield _count_by_chars, "characters / 4 (the endpoint has no /tokenize)"


def _count_by_chars(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))
