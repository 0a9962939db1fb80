"""The admin endpoint: list, add, drain and remove nodes while the proxy runs (proxy.discovery
does the work). Every route needs "Authorization: Bearer <admin token>" (--admin-token); without
a token the routes exist only on a loopback proxy, where only this machine reaches them.

    GET    /admin/nodes                      every node: name, kind, address, sources, state, requests
    POST   /admin/nodes {"kind", "address"}  add a node (201)
    POST   /admin/nodes/{node}/drain         the node drains itself (as SIGTERM) and exits (202)
    DELETE /admin/nodes/{node}               out of this proxy's pool once its requests end (202)

{node} is an address (HOST:PORT) or a name from the listing ("decode1"); ?kind= picks one when
a prefill and a decode node share an address.
"""

from __future__ import annotations

import hmac
import logging
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from proxy.discovery import Discovery
from proxy.errors import ApiError, NodeDied

logger = logging.getLogger(__name__)


class NewNode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["prefill", "decode"]
    address: str


def admin_router(discovery: Discovery, token: str | None) -> APIRouter:
    """The /admin routes over discovery, behind token (None: no check; the caller mounts them
    without one only on a loopback proxy)."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(_token_check(token))], include_in_schema=False)

    @router.get("/nodes")
    async def list_nodes():
        return {"nodes": discovery.describe()}

    @router.post("/nodes")
    async def add_node(request: Request):
        try:
            body = NewNode.model_validate_json(await request.body())
        except ValueError as exc:
            raise ApiError(400, f"expected {{\"kind\": \"prefill\"|\"decode\", \"address\": \"HOST:PORT\"}}: {exc}",
                           kind="invalid_request_error") from None
        try:
            node = discovery.add(body.kind, body.address)
        except ValueError as exc:
            raise ApiError(400, str(exc), "address") from None
        logger.info("admin: added %s node %s", body.kind, body.address)
        return JSONResponse(_one(discovery, node.address, node.kind), status_code=201)

    @router.post("/nodes/{node}/drain")
    async def drain_node(node: str, kind: str | None = None):
        try:
            found = discovery.drain(node, kind)
        except KeyError as exc:
            raise ApiError(404, str(exc.args[0]), "node", code="node_not_found") from None
        except NodeDied as exc:
            raise ApiError(409, f"{exc}: it cannot be asked to drain", "node") from None
        logger.info("admin: drain sent to %s node %s", found.kind, found.address)
        return JSONResponse(_one(discovery, found.address, found.kind), status_code=202)

    @router.delete("/nodes/{node}")
    async def remove_node(node: str, kind: str | None = None):
        try:
            found = discovery.remove(node, kind)
        except KeyError as exc:
            raise ApiError(404, str(exc.args[0]), "node", code="node_not_found") from None
        logger.info("admin: removing %s node %s once its %d requests end", found.kind, found.address,
                    len(found.queues))
        listed = [n for n in discovery.describe() if n["address"] == found.address and n["kind"] == found.kind]
        state = listed[0] if listed else {"kind": found.kind, "address": found.address, "state": "removed",
                                          "requests_sent": found.num_requests_sent, "requests_in_flight": 0}
        return JSONResponse(state, status_code=202)

    return router


def _one(discovery: Discovery, address: str, kind: str) -> dict:
    return next(n for n in discovery.describe() if n["address"] == address and n["kind"] == kind)


def _token_check(token: str | None):
    expected = f"Bearer {token}".encode()

    async def check_admin_token(request: Request) -> None:
        given = request.headers.get("authorization", "").encode("latin-1")
        # NOTE: constant time, so the token cannot be guessed byte by byte from response times.
        if token is not None and not hmac.compare_digest(given, expected):
            raise ApiError(401, "invalid or missing admin token", kind="authentication_error",
                           code="invalid_admin_token")

    return check_admin_token
