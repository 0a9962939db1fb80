"""The request and error bodies as /openapi.json describes them. The endpoints read their bodies
themselves (bounded, see proxy.uploads and proxy.limits), so FastAPI does not see them: each
route declares its body with body_spec(), and install_openapi() adds the models' JSON schemas to
the document."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
ERROR_SCHEMA_NAME = "ErrorResponse"
# Every error the API answers: an OpenAI error object (see proxy.errors.ApiError.body).
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ERROR_STATUSES = {"400": "Bad request (the message and param say what)", "401": "Missing or wrong API key",
                   "404": "Unknown model", "408": "The body did not arrive in time",
                   "413": "The body is too large", "429": "Overloaded: retry after Retry-After seconds",
                   "500": "A node failed the request", "502": "A node died", "503": "No node can serve it",
                   "504": "A node did not answer in time"}


def body_spec(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's openapi_extra: a required JSON body of one of models, and the error answers."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model=ERROR_SCHEMA_NAME)}}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {status: {"description": text, **error} for status, text in _ERROR_STATUSES.items()}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]], is_strict_fields: bool = False) -> None:
    """Make app's /openapi.json hold the JSON schemas (as validated) of models and the error body;
    is_strict_fields: models that ignore unknown fields (proxy.field_policy.GENERATION) refuse them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(definitions.get("$defs", {}))
            for model in models:
                if is_strict_fields and model.model_config.get("extra") == "ignore":
                    schemas[model.__name__]["additionalProperties"] = False
            schemas[ERROR_SCHEMA_NAME] = _ERROR_SCHEMA
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
