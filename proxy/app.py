"""The OpenAI-compatible HTTP front: routes (/v1/completions, /v1/chat/completions, /v1/models;
vLLM's /tokenize, /detokenize, /version; /health, /metrics), the API key check, X-Request-Id,
and run() to serve them. No torch: nodes see token ids."""

from __future__ import annotations

import hmac
import importlib.metadata
import re
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.chat_schemas import ChatCompletionRequest, TokenizeChatRequest
from proxy.config import ProxyConfig
from proxy.errors import ApiError, install_handlers
from proxy.metrics import ProxyMetrics
from proxy.nodes import LocalPrefillPolicy, NodePool
from proxy.openai_format import ChatFormat, CompletionFormat
from proxy.request_id import RequestIdMiddleware
from proxy.schemas import (
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
    json_object,
    parse_body,
    parse_data,
)
from proxy.service import RequestService
from proxy.tokenizer import ModelTokenizer

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def run(config: ProxyConfig, log_level: str = "info") -> None:
    """Serve the API with uvicorn (one worker) until SIGINT/SIGTERM; blocks."""
    import uvicorn  # NOTE: here, not at the top: tests and importers of create_app need no server

    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=log_level.lower(), workers=1,
                timeout_graceful_shutdown=5)


def create_app(config: ProxyConfig) -> FastAPI:
    """The FastAPI app; node sockets open at startup (lifespan) and close at shutdown. Reads
    the tokenizer files of config.model_dir now (raises OSError/ValueError if they are bad)."""
    tokenizer = ModelTokenizer.from_dir(config.model_dir, config.chat_template_timeout_s, config.chat_template_path,
                                        config.trust_request_chat_template)
    pool = NodePool(config.prefill_addresses, config.decode_addresses, config.heartbeat_timeout_s,
                    _local_prefill_policy(config))
    metrics = ProxyMetrics(lambda: pool.all, lambda: pool.num_local_prefills)
    service = RequestService(config, tokenizer, pool, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        yield
        await pool.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.pool = pool
    app.add_middleware(RequestIdMiddleware)
    install_handlers(app)
    _add_status_routes(app, pool, metrics)
    app.include_router(_api_router(config, service))
    app.include_router(_tokenizer_router(config, service))
    return app


def _local_prefill_policy(config: ProxyConfig) -> LocalPrefillPolicy | None:
    if config.local_prefill_min_wait_s is None:
        return None
    return LocalPrefillPolicy(config.local_prefill_min_wait_s, config.local_prefill_penalty)


def _add_status_routes(app: FastAPI, pool: NodePool, metrics: ProxyMetrics) -> None:
    """/health (503 naming the nodes down) and /metrics; open to all."""

    @app.get("/health")
    async def health():
        down = pool.down()
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _api_router(config: ProxyConfig, service: RequestService) -> APIRouter:
    """/v1/: the OpenAI endpoints, behind the API key when one is set."""
    # NOTE: a dependency, not an HTTP middleware: BaseHTTPMiddleware wraps receive(), which the
    # disconnect watchers of the endpoints rely on.
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(config.api_key))])
    model = config.served_model_name

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "pdserve",
                                            "max_model_len": service.max_model_len()}]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = parse_body(await request.body(), CompletionRequest)
        return await service.complete(body, CompletionFormat(model, request.state.request_id, body.echo), request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await request.body(), ChatCompletionRequest)
        return await service.complete(body, ChatFormat(model, request.state.request_id, body.tool_policy()), request)

    return v1


def _tokenizer_router(config: ProxyConfig, service: RequestService) -> APIRouter:
    """vLLM's /tokenize, /detokenize and /version, behind the same API key as /v1/."""
    router = APIRouter(dependencies=[Depends(_api_key_check(config.api_key))])

    @router.post("/tokenize")
    async def tokenize(request: Request):
        data = json_object(await request.body())
        return await service.tokenize(parse_data(data, TokenizeChatRequest if "messages" in data
                                                 else TokenizeCompletionRequest))

    @router.post("/detokenize")
    async def detokenize(request: Request):
        return service.detokenize(parse_body(await request.body(), DetokenizeRequest))

    @router.get("/version")
    async def version():
        return {"version": _version()}

    return router


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
