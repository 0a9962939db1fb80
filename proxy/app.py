"""The OpenAI-compatible HTTP front: routes (/v1/completions, /v1/chat/completions, /v1/models;
vLLM's /tokenize, /detokenize, /version; /health, /metrics), the API key check, X-Request-Id,
admission and bounded bodies, and run() to serve them on guarded connections. No torch: nodes
see token ids."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import re
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from engine.gc_policy import freeze_start_up_objects
from engine.protocol import curve_keys
from proxy.admin import admin_router
from proxy.admission import Admission, AdmissionLimits, Ticket
from proxy.chat_schemas import ChatCompletionRequest, TokenizeChatRequest
from proxy.config import ProxyConfig
from proxy.connection_guard import ConnectionLimits, guarded_protocol
from proxy.discovery import Discovery, DiscoveryConfig, is_loopback_address
from proxy.drain import DrainingServer, ProxyDrain
from proxy.errors import ApiError, install_handlers
from proxy.field_policy import IgnoredFieldsLog, ignored_fields_header
from proxy.log_context import RequestLogContext, install_record_factory
from proxy.metrics import ProxyMetrics
from proxy.node_metrics import NodeSeries
from proxy.node_names import NodeNames
from proxy.nodes import LocalPrefillPolicy, NodePool, RetryLimits
from proxy.openai_format import ChatFormat, CompletionFormat, ResponseFormat
from proxy.openapi_bodies import body_spec, install_openapi
from proxy.request_id import RequestIdMiddleware
from proxy.routing import RoutingConfig
from proxy.schemas import (
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeCompletionRequest,
    json_object,
    parse_body,
    parse_data,
)
from proxy.service import RequestService
from proxy.tokenizer import ModelTokenizer
from proxy.uploads import BodyReader, UploadLimits

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_Body = TypeVar("_Body", bound=BaseModel)
# Bodies past this size are parsed in a worker thread, so other requests' streams go on meanwhile
# (parsing and validating a multi-megabyte body takes tens to hundreds of milliseconds).
_PARSE_IN_THREAD_BYTES = 256 << 10


def run(config: ProxyConfig, log_level: str = "info") -> None:
    """Serve the API with uvicorn (one worker) until SIGINT, or SIGTERM and a drain (proxy.drain); blocks."""
    import uvicorn  # NOTE: here, not at the top: tests and importers of create_app need no server

    app = create_app(config)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                                           workers=1, timeout_graceful_shutdown=5, loop="uvloop",
                                           # NOTE: uvicorn's loggers go to the root handler (pdserve.logs: text
                                           # or JSON); the access line comes from proxy.log_context, with its id.
                                           log_config=None, access_log=False, **server_options(config)),
                            app.state.drain)
    logging.getLogger(__name__).info("%d start-up objects frozen (no collection traverses them)",
                                     freeze_start_up_objects())
    server.run()


def server_options(config: ProxyConfig) -> dict:
    """The uvicorn.Config fields that bound each connection: header and keep-alive deadlines
    (proxy.connection_guard, on uvicorn's httptools protocol). run() uses them; so do tests."""
    return {"http": guarded_protocol(ConnectionLimits(config.header_timeout_s)),
            "timeout_keep_alive": config.keep_alive_timeout_s}


def create_app(config: ProxyConfig) -> FastAPI:
    """The FastAPI app; node sockets open at startup (lifespan) and close at shutdown. Reads
    the tokenizer files of config.model_dir now (raises OSError/ValueError if they are bad)."""
    tokenizer = ModelTokenizer.from_dir(config.model_dir, config.chat_template_timeout_s, config.chat_template_path,
                                        config.trust_request_chat_template)
    pool = NodePool(config.prefill_addresses, config.decode_addresses, config.heartbeat_timeout_s,
                    _local_prefill_policy(config),
                    curve_keys(config.cluster_secret) if config.cluster_secret is not None else None,
                    config.stall_timeout_s, RetryLimits(config.max_attempts, config.max_migrations,
                                                                      config.decode_wait_s),
                    RoutingConfig.of(config), config.kv_stream_min_tokens)
    names = NodeNames(config.prefill_addresses, config.decode_addresses, config.expose_node_addresses)
    metrics = ProxyMetrics(lambda: pool.all, lambda: pool.num_local_prefills, names.name)
    node_metrics = NodeSeries(lambda: pool.all if config.node_metrics else ())
    metrics.registry.register(node_metrics)
    admission = Admission(_admission_limits(config), pool, metrics)
    metrics.in_flight.set_function(lambda: admission.num_in_flight)
    reader = BodyReader(_upload_limits(config), metrics)
    metrics.uploads.set_function(lambda: reader.uploads.num_held)
    service = RequestService(config, tokenizer, pool, metrics, admission, names, reader)
    discovery = _discovery(config, pool, names)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        await discovery.start()
        yield
        await discovery.stop()
        await pool.stop()
        await node_metrics.close()

    app = FastAPI(title="pdserve", version=_version(), lifespan=lifespan)
    app.state.pool = pool
    app.state.ledger = metrics.ledger
    app.state.discovery = discovery
    app.state.drain = ProxyDrain(admission, pool, config.drain_timeout_s)  # started by SIGTERM (run())
    install_record_factory()
    app.add_middleware(RequestLogContext)  # NOTE: added first, so it runs inside RequestIdMiddleware
    app.add_middleware(RequestIdMiddleware)
    install_handlers(app)
    _add_status_routes(app, pool, metrics, names, node_metrics)
    app.include_router(_api_router(config, service))
    app.include_router(_tokenizer_router(config, service))
    if config.admin_token is not None or is_loopback_address(f"{config.host}:{config.port}"):
        app.include_router(admin_router(discovery, config.admin_token))
    else:
        logging.getLogger(__name__).warning("no --admin-token: /admin/nodes is off (this proxy listens beyond "
                                            "loopback)")
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                          DetokenizeRequest], config.strict_fields)
    return app


def _discovery(config: ProxyConfig, pool: NodePool, names: NodeNames) -> Discovery:
    """Keeps the pool equal to the static nodes, the DNS names' records, the node file and the
    admin's changes; a node beyond loopback only with a cluster secret."""
    static = {"prefill": frozenset(config.prefill_addresses), "decode": frozenset(config.decode_addresses)}
    settings = DiscoveryConfig(config.prefill_dns, config.decode_dns, config.nodes_file, config.discovery_interval_s)
    return Discovery(pool, names, static, settings,
                     lambda address: config.cluster_secret is not None or is_loopback_address(address))


def _admission_limits(config: ProxyConfig) -> AdmissionLimits:
    return AdmissionLimits(config.max_num_requests, config.max_queue_wait_s,
                           None if config.slo_ttft_ms is None else config.slo_ttft_ms / 1000,
                           config.max_node_waiting, config.max_client_requests)


def _upload_limits(config: ProxyConfig) -> UploadLimits:
    return UploadLimits(config.max_body_bytes, config.body_timeout_s, config.min_upload_bytes_per_s,
                        config.upload_rate_window_s, config.max_client_uploads)


def _local_prefill_policy(config: ProxyConfig) -> LocalPrefillPolicy | None:
    if config.local_prefill_min_wait_s is None:
        return None
    return LocalPrefillPolicy(config.local_prefill_min_wait_s, config.local_prefill_penalty)


def _add_status_routes(app: FastAPI, pool: NodePool, metrics: ProxyMetrics, names: NodeNames,
                       node_metrics: NodeSeries) -> None:
    """/health (503 naming the nodes down), /ready (200 while a new request can be served: a
    readiness probe) and /metrics (the proxy's series and the nodes' vllm:* ones); open to all, so
    nodes appear by name."""

    @app.get("/health")
    async def health():
        down = [names.redact(problem) for problem in pool.down()]
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if app.state.drain.is_draining:
            return JSONResponse({"status": "not ready", "reason": "shutting down"}, status_code=503)
        if pool.has_serving_path():
            return {"status": "ready"}
        return JSONResponse({"status": "not ready", "reason": "no decode node takes requests"}, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render() + await node_metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _api_router(config: ProxyConfig, service: RequestService) -> APIRouter:
    """/v1/: the OpenAI endpoints, behind the API key when one is set. Each request holds a
    ticket of the admission from when its body has arrived until its choices run (see Ticket)."""
    # NOTE: a dependency, not an HTTP middleware: BaseHTTPMiddleware wraps receive(), which the
    # disconnect watchers of the endpoints rely on.
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(config.api_key))])
    model = config.served_model_name
    parse = partial(parse_body, is_strict=config.strict_fields)
    complete = _IgnoredFieldsNotice(service, IgnoredFieldsLog()).complete

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": service.max_model_len()}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        """The openai client's models.retrieve (ids may hold slashes: org/name)."""
        if model_id != model:
            raise ApiError(404, f"model {model_id!r} does not exist; this server serves {model!r}", "model",
                           code="model_not_found")
        return model_card()

    @v1.post("/completions", openapi_extra=body_spec(CompletionRequest))
    async def completions(request: Request, response: Response):
        raw, ticket = await service.admit(CompletionFormat.endpoint, request)
        try:
            body = await _parse(raw, parse, CompletionRequest)
            fmt = CompletionFormat(model, request.state.request_id, body.echo)
            return await complete(body, fmt, request, response, ticket)
        finally:
            ticket.release()

    @v1.post("/chat/completions", openapi_extra=body_spec(ChatCompletionRequest))
    async def chat_completions(request: Request, response: Response):
        raw, ticket = await service.admit(ChatFormat.endpoint, request)
        try:
            body = await _parse(raw, parse, ChatCompletionRequest)
            fmt = ChatFormat(model, request.state.request_id, body.tool_policy())
            return await complete(body, fmt, request, response, ticket)
        finally:
            ticket.release()

    return v1


class _IgnoredFieldsNotice:
    """Answers completion requests through service, telling of the fields each had ignored: in
    the Pdserve-Ignored-Fields header of its answer (an error too) and in log's WARNING lines."""

    def __init__(self, service: RequestService, log: IgnoredFieldsLog) -> None:
        self.service = service
        self.log = log

    async def complete(self, body: GenerationRequest, fmt: ResponseFormat, request: Request, response: Response,
                       ticket: Ticket) -> Response | dict:
        """service.complete(); response: FastAPI's, whose headers go on a dict's answer."""
        headers = ignored_fields_header(body.ignored_fields)
        if not headers:
            return await self.service.complete(body, fmt, request, ticket)
        self.log.note(fmt.endpoint, body.ignored_fields)
        try:
            answer = await self.service.complete(body, fmt, request, ticket)
        except ApiError as exc:
            raise exc.with_headers(headers) from exc
        # NOTE: FastAPI puts response's headers on the answer it makes of a dict.
        (answer if isinstance(answer, Response) else response).headers.update(headers)
        return answer


def _tokenizer_router(config: ProxyConfig, service: RequestService) -> APIRouter:
    """vLLM's /tokenize, /detokenize and /version, behind the same API key as /v1/; each holds
    one admission slot while it runs."""
    router = APIRouter(dependencies=[Depends(_api_key_check(config.api_key))])

    @router.post("/tokenize", openapi_extra=body_spec(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(request: Request):
        raw, ticket = await service.admit(request.url.path.strip("/"), request)
        try:
            return await service.tokenize(await _parse(raw, _parse_tokenize, None))
        finally:
            ticket.release()

    @router.post("/detokenize", openapi_extra=body_spec(DetokenizeRequest))
    async def detokenize(request: Request):
        raw, ticket = await service.admit(request.url.path.strip("/"), request)
        try:
            return await service.detokenize(await _parse(raw, parse_body, DetokenizeRequest))
        finally:
            ticket.release()

    @router.get("/version")
    async def version():
        return {"version": _version()}

    return router


async def _parse(raw: bytes, parse: Callable[[bytes, type[_Body] | None], _Body],
                 model: type[_Body] | None) -> _Body:
    """parse(raw, model), in a worker thread for a large body; raises ApiError (400)."""
    if len(raw) > _PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse, raw, model)
    return parse(raw, model)


def _parse_tokenize(raw: bytes, _model: None) -> TokenizeCompletionRequest | TokenizeChatRequest:
    data = json_object(raw)
    return parse_data(data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)


def _version() -> str:
    """pdserve's version: the installed package's, else pyproject.toml's (a source checkout)."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        found = re.search(r'^version\s*=\s*"([^"]+)"', _PYPROJECT.read_text(), re.MULTILINE)
        return found.group(1) if found else "unknown"


def _api_key_check(api_key: str | None):
    """A dependency raising ApiError 401 unless the request bears "Authorization: Bearer api_key"
    (no check when api_key is None)."""
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode("latin-1")  # the bytes as sent
        # NOTE: constant time, so the key cannot be guessed byte by byte from response times.
        if api_key and not hmac.compare_digest(given, expected):
            raise ApiError(401, "invalid or missing API key", kind="authentication_error", code="invalid_api_key")

    return check_api_key
