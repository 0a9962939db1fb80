"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics. No torch: nodes see token ids only; text lives here."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from proxy.choices import ChoiceState
from proxy.config import ProxyConfig
from proxy.flow import NodeRejected, NoNodeAvailable, run_request
from proxy.metrics import ProxyMetrics
from proxy.nodes import LocalPrefillPolicy, NodeDied, NodePool
from proxy.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from proxy.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class SubRequest:
    """One choice: a prompt (token ids) sampled once."""

    request_id: str
    index: int
    prompt_ids: list[int]
    prompt_text: str | None
    sampling: object


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def run(config: ProxyConfig, log_level: str = "info") -> None:
    """Serve the API with uvicorn (one worker) until SIGINT/SIGTERM; blocks."""
    import uvicorn  # NOTE: here, not at the top: tests and importers of create_app need no server

    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=log_level.lower(), workers=1,
                timeout_graceful_shutdown=5)


def create_app(config: ProxyConfig) -> FastAPI:
    """The FastAPI app; node sockets open at startup (lifespan) and close at shutdown. Reads
    the tokenizer files of config.model_dir now (raises OSError/ValueError if they are bad)."""
    tokenizer = ModelTokenizer.from_dir(config.model_dir)
    local_prefill = None
    if config.local_prefill_min_wait_s is not None:
        local_prefill = LocalPrefillPolicy(config.local_prefill_min_wait_s, config.local_prefill_penalty)
    pool = NodePool(config.prefill_addresses, config.decode_addresses, config.heartbeat_timeout_s, local_prefill)
    metrics = ProxyMetrics(lambda: pool.all, lambda: pool.num_local_prefills)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        yield
        await pool.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.pool = pool
    service = _Service(config, tokenizer, pool, metrics)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        return error_response(_from_validation(exc.errors()))

    # NOTE: a dependency, not an HTTP middleware: BaseHTTPMiddleware wraps receive(), which the
    # disconnect watchers of the endpoints rely on.
    async def check_api_key(request: Request) -> None:
        if config.api_key and request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise ApiError(401, "invalid or missing API key", kind="authentication_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health():
        down = pool.down()
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": service.max_model_len()}]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        return await service.complete(body, chat=False, request=request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        return await service.complete(body, chat=True, request=request)

    app.include_router(v1)  # NOTE: after the routes: include_router copies them
    return app


async def _parse(request: Request, model: type[_SamplingFields]):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc.errors()) from exc


def _from_validation(errors) -> ApiError:
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return ApiError(400, f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg")), param)


class _Service:
    def __init__(self, config: ProxyConfig, tokenizer: ModelTokenizer, pool: NodePool, metrics: ProxyMetrics) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics

    def max_model_len(self) -> int:
        return self.config.max_model_len or self.pool.max_model_len() or self.tokenizer.max_position_embeddings

    async def complete(self, body, chat: bool, request: Request):
        arrived_at = time.monotonic()
        endpoint = "chat" if chat else "completions"
        if body.model != self.config.served_model_name:
            self.metrics.requests.labels(endpoint, "404").inc()
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", "model", code="model_not_found")
        try:
            subs = self._sub_requests(body, chat)
        except ApiError:
            self.metrics.requests.labels(endpoint, "400").inc()
            raise
        if body.stream:
            return await self._start_stream(body, subs, chat, endpoint, arrived_at, request)
        return await self._complete_all(body, subs, chat, endpoint, arrived_at, request)

    def _sub_requests(self, body, chat: bool) -> list[SubRequest]:
        if chat:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                prompts = [(self.tokenizer.apply_chat_template(messages, body.add_generation_prompt), None)]
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages") from exc
            num_logprobs, requested = body.num_logprobs, body.requested_max_tokens
        else:
            if body.echo and body.logprobs is not None:
                raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
            prompts = [(self.tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None) for p in body.prompts()]
            num_logprobs, requested = body.logprobs, body.max_tokens or 16
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        subs = []
        for prompt_idx, (ids, text) in enumerate(prompts):
            self._check_prompt(ids)
            max_tokens = min(requested or self.max_model_len(), self.max_model_len() - len(ids))
            for i in range(body.n):
                index = prompt_idx * body.n + i
                sampling = body.sampling(max_tokens, num_logprobs, seed_offset=i)
                subs.append(SubRequest(f"{base_id}-{index}", index, ids, text, sampling))
        return subs

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ApiError(400, "prompt is empty after tokenization", "prompt")
        limit = self.max_model_len()
        if len(ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(ids)} tokens (at least one output token must fit)", "prompt",
                           code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {self.tokenizer.vocab_size})", "prompt")

    async def _run_choice(self, sub: SubRequest, state: ChoiceState, out: asyncio.Queue, arrived_at: float) -> None:
        """Feed one choice's deltas into out; ends with (index, None) or (index, exception)."""
        start = arrived_at
        last = None
        try:
            stream = run_request(self.pool, sub.request_id, sub.prompt_ids, sub.sampling,
                                 self.config.first_token_timeout_s, self.config.request_timeout_s)
            async for step in stream:
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.observe(now - start)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                delta = state.add(step.tokens, step.finish_reason)
                await out.put((sub.index, delta))
                if delta.finish_reason is not None:
                    await stream.aclose()  # a stop string: the finally of run_request aborts
                    break
            self.metrics.e2e.observe(time.monotonic() - start)
            self.metrics.generation_tokens.inc(state.num_tokens)
            self.metrics.prompt_tokens.inc(len(sub.prompt_ids))
            await out.put((sub.index, None))
        except asyncio.CancelledError:
            self.metrics.aborts.labels("disconnect").inc()
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client by the consumer
            self.metrics.aborts.labels(type(exc).__name__).inc()
            await out.put((sub.index, exc))

    def _start(self, subs: list[SubRequest], stops: list[str], arrived_at: float):
        states = {s.index: ChoiceState(s.index, self.tokenizer, stops, s.sampling.logprobs is not None)
                  for s in subs}
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(s, states[s.index], out, arrived_at)) for s in subs]
        return states, out, tasks

    async def _complete_all(self, body, subs: list[SubRequest], chat: bool, endpoint: str, arrived_at: float,
                            request: Request):
        states, out, tasks = self._start(subs, body.stop_strings, arrived_at)
        # NOTE: uvicorn does not cancel a non-streaming handler when its client goes away; this
        # watcher does, so the nodes hear Abort instead of generating for nobody.
        tasks.append(asyncio.create_task(_report_disconnect(request, out)))
        try:
            remaining = len(subs)
            while remaining:
                _, item = await out.get()
                if isinstance(item, ClientGone):
                    self.metrics.requests.labels(endpoint, "499").inc()
                    return Response(status_code=499)  # nobody reads it; the finally aborts on the nodes
                if isinstance(item, Exception):
                    raise _api_error_of(item)
                if item is None:
                    remaining -= 1
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        finally:
            for task in tasks:
                task.cancel()
        self.metrics.requests.labels(endpoint, "200").inc()
        return _final_body(body, subs, states, chat, self.config.served_model_name)

    async def _start_stream(self, body, subs: list[SubRequest], chat: bool, endpoint: str, arrived_at: float,
                            request: Request) -> Response:
        """Hold the response until the first token (or failure) of any choice, so a request that
        fails before streaming began gets a real status code rather than an SSE error."""
        events = self._stream(body, subs, chat, arrived_at, request)
        try:
            first = await anext(events)
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        except ClientGone:
            self.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        self.metrics.requests.labels(endpoint, "200").inc()
        return StreamingResponse(_chain(first, events), media_type="text/event-stream")

    async def _stream(self, body, subs: list[SubRequest], chat: bool, arrived_at: float, request: Request):
        """SSE events of all choices; raises ApiError or ClientGone instead of a first event."""
        states, out, tasks = self._start(subs, body.stop_strings, arrived_at)
        base = _chunk_base(subs[0].request_id.rsplit("-", 1)[0], chat, self.config.served_model_name)
        try:
            index, item = await _first_item(out, request)
            yield self._preamble(base, subs, states, chat, not chat and body.echo)
            remaining = len(subs)
            while True:
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    yield _sse(_api_error_of(item).body())
                    break
                else:
                    choice = _stream_choice(states[index], item, chat)
                    if choice["logprobs"] is not None or choice["finish_reason"] is not None or item.text:
                        yield _sse({**base, "choices": [choice]})
                if not remaining:
                    break
                index, item = await out.get()
            if body.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(subs, states)})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()  # client gone or done: run_request's finally aborts on the nodes


    def _preamble(self, base: dict, subs: list[SubRequest], states: dict[int, ChoiceState], chat: bool,
                  echo: bool) -> str:
        """The events before the first token: each chat choice's role, or each echoed prompt."""
        events = []
        for sub in subs:
            if chat:
                choice = {"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
            elif echo:
                text = sub.prompt_text if sub.prompt_text is not None else self.tokenizer.decode(sub.prompt_ids)
                states[sub.index].text_offset = len(text)
                choice = {"index": sub.index, "text": text, "logprobs": None, "finish_reason": None}
            else:
                continue
            events.append(_sse({**base, "choices": [choice]}))
        return "".join(events)


async def _first_item(out: asyncio.Queue, request: Request) -> tuple:
    """The first (index, delta) of any choice; raises ApiError if it is a failure, ClientGone
    if the client left before."""
    watcher = asyncio.create_task(_report_disconnect(request, out))
    try:
        index, item = await out.get()
    finally:
        watcher.cancel()
    if isinstance(item, ClientGone):
        raise item
    if isinstance(item, Exception):
        raise _api_error_of(item)
    return index, item


async def _chain(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()  # NOTE: completes without suspending: rest's finally only cancels tasks


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _report_disconnect(request: Request, out: asyncio.Queue) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    await out.put((None, ClientGone()))


def _api_error_of(exc: Exception) -> ApiError:
    if isinstance(exc, NodeRejected):
        status = 400 if exc.reply.is_client_error else 500
        return ApiError(status, exc.reply.message, kind="invalid_request_error" if status == 400 else "server_error")
    if isinstance(exc, NoNodeAvailable):
        return ApiError(503, str(exc), kind="server_error")
    if isinstance(exc, (NodeDied, TimeoutError)):
        return ApiError(502 if isinstance(exc, NodeDied) else 504, str(exc), kind="server_error")
    logger.exception("request failed", exc_info=exc)
    return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _chunk_base(request_id: str, chat: bool, model: str) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}


def _stream_choice(state: ChoiceState, delta, chat: bool) -> dict:
    if chat:
        return {"index": state.index, "delta": {"content": delta.text},
                "logprobs": state.chat_logprobs(delta.tokens), "finish_reason": delta.finish_reason}
    return {"index": state.index, "text": delta.text, "logprobs": state.completion_logprobs(delta.tokens),
            "finish_reason": delta.finish_reason}


def _usage(subs: list[SubRequest], states: dict[int, ChoiceState]) -> dict:
    prompt = _prompt_tokens(subs)
    completion = sum(state.num_tokens for state in states.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompt_tokens(subs: list[SubRequest]) -> int:
    """Each prompt counts once, however many choices (n) it has."""
    first_choice = {}
    for sub in subs:
        first_choice.setdefault(id(sub.prompt_ids), len(sub.prompt_ids))
    return sum(first_choice.values())


def _final_body(body, subs: list[SubRequest], states: dict[int, ChoiceState], chat: bool, model: str) -> dict:
    request_id = subs[0].request_id.rsplit("-", 1)[0]
    choices = []
    for sub in subs:
        state = states[sub.index]
        if chat:
            choices.append({"index": sub.index, "message": {"role": "assistant", "content": state.text},
                            "logprobs": state.chat_logprobs(state.tokens), "finish_reason": state.finish_reason})
            continue
        echo = ""
        if body.echo:
            echo = sub.prompt_text if sub.prompt_text is not None else state.tokenizer.decode(sub.prompt_ids)
        state.text_offset = len(echo)
        choices.append({"index": sub.index, "text": echo + state.text, "logprobs": state.completion_logprobs(state.tokens),
                        "finish_reason": state.finish_reason})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(subs, states)}
