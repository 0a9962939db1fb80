"""The request fields that ask for a grammar: OpenAI's response_format (json_object,
json_schema) and vLLM's structured_outputs, each as the StructuredOutput the nodes enforce
(proxy.schemas adds the guided_* fields, and checks that a request asks for one grammar at most
and that it is within the grammar budget)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from engine.protocol import StructuredKind, StructuredOutput
from proxy import limits
from proxy.errors import ApiError
from proxy.field_policy import STRICT


class JsonSchemaSpec(BaseModel):
    """response_format's json_schema: OpenAI's {"name", "description", "schema", "strict"}. The
    schema is always enforced by the grammar, strict or not (strict only promises more)."""

    model_config = STRICT

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (free text), "json_object" (any JSON object) or
    "json_schema" (JSON matching json_schema.schema)."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given_for_json_schema_only(self) -> ResponseFormat:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise ValueError(f"json_schema is given only with type \"json_schema\", not {self.type!r}")
        elif self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("type \"json_schema\" needs json_schema.schema (a JSON schema object)")
        return self

    def structured(self) -> StructuredOutput | None:
        """The grammar the engine enforces; None for free text."""
        if self.type == "json_object":
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if self.type == "json_schema":
            return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(self.json_schema.schema_))
        return None


def schema_object(schema: dict[str, Any] | str | None, field: str) -> dict[str, Any] | None:
    """A JSON schema given as an object or as its JSON text (vLLM takes both), as an object;
    raises ValueError naming field for anything else."""
    if isinstance(schema, str):
        try:
            schema = limits.loads(schema)
        except ValueError:
            raise ValueError(f"{field} must be a JSON schema: an object, or its JSON text") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{field} must be a JSON schema: an object, or its JSON text")
    return schema


class StructuredOutputsSpec(BaseModel):
    """vLLM's structured_outputs: exactly one constraint of json (a JSON schema, or its text),
    json_object, regex, choice, grammar (EBNF) and structural_tag, all enforced (as guided_json,
    response_format json_object, guided_regex, guided_choice and guided_grammar) but
    structural_tag. disable_additional_properties is what the grammar always does (a schema
    allows no property it does not list unless it says so) and disable_fallback changes nothing
    (there is one backend); whitespace_pattern is refused, and disable_any_whitespace with json
    or json_object (it changes nothing for the others, as in vLLM)."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @field_validator("json_")
    @classmethod
    def _schema_object(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return schema_object(schema, "structured_outputs.json")

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsSpec:
        given = [name for name in _CONSTRAINTS if getattr(self, _attribute(name)) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS[:-1])} and "
                             f"{_CONSTRAINTS[-1]}, got {given or 'none'}")
        return self

    @property
    def param(self) -> str:
        """The field that holds the constraint, as an error's param ("structured_outputs.regex")."""
        return "structured_outputs." + next(name for name in _CONSTRAINTS
                                            if getattr(self, _attribute(name)) not in (None, False))

    def check_supported(self) -> None:
        """Raises ApiError (400) naming the part that cannot be honoured."""
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"structured_outputs.{name} is not supported: the nodes' grammars take JSON "
                                    "schemas, regular expressions, choices and EBNF grammars",
                               f"structured_outputs.{name}")
        if self.disable_any_whitespace and (self.json_ is not None or self.json_object):
            raise ApiError(400, "structured_outputs.disable_any_whitespace is not supported: the grammar allows "
                                "whitespace between JSON tokens", "structured_outputs.disable_any_whitespace")

    def structured(self) -> StructuredOutput:
        """The grammar the engine enforces (after check_supported: not structural_tag)."""
        if self.json_ is not None:
            return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(self.json_))
        if self.regex is not None:
            return StructuredOutput(StructuredKind.REGEX, regex=self.regex)
        if self.choice is not None:
            return StructuredOutput(StructuredKind.CHOICE, choices=tuple(self.choice))
        if self.grammar is not None:
            return StructuredOutput(StructuredKind.EBNF, grammar=self.grammar)
        return StructuredOutput(StructuredKind.JSON_OBJECT)


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _attribute(name: str) -> str:
    return "json_" if name == "json" else name
