"""Chat request bodies: messages as OpenAI clients send them (text or text parts, assistant
tool_calls, tool results), the chat template fields (tools, documents, add_generation_prompt,
continue_final_message, chat_template, chat_template_kwargs) shared by /v1/chat/completions
and /tokenize, the Conversation they give the chat template, and tool_choice as a ToolPolicy."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from engine.protocol import StructuredKind, StructuredOutput
from proxy import limits
from proxy.errors import ApiError, ChatTemplateError
from proxy.field_policy import GENERATION, STRICT
from proxy.schemas import GenerationRequest, Prompt, limit_field, sampling_field
from proxy.templates import Conversation
from proxy.tokenizer import ModelTokenizer
from proxy.tool_calls import ToolChoiceMode, ToolPolicy


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. The template sees it as the client sent it (same keys, same order), with
    vLLM's changes: text parts joined by newlines, tool call arguments parsed into objects,
    an empty tool_calls dropped; and transformers': keys whose value is null dropped."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: OpenAI's {"id", "type", "function"}
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning: str | None = None  # assistant: earlier reasoning (vLLM's field; templates read it)
    reasoning_content: str | None = None
    refusal: None = None  # OpenAI's assistant messages carry "refusal": null; clients send them back
    _key_order: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_key_order(cls, data: Any, handler) -> ChatMessage:
        message = handler(data)
        message._key_order = list(data) if isinstance(data, dict) else []
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _text_content_only(cls, content: Any) -> Any:
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError("content must be a string, a list of text parts, or null")
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
            unsupported = [k for k in kinds if k != "text"]
            if unsupported:
                raise ValueError(f"content parts of type {unsupported[0]!r} are not supported (text only)")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _parse_tool_calls(cls, tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if tool_calls is None else [_parsed_tool_call(call) for call in tool_calls]

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        # NOTE: as OpenAI: content is required but for an assistant message with tool calls.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts); null or "
                             "missing is allowed only for an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not {self.role}")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template gets it (a fresh dict, the client's key order)."""
        values = {name: getattr(self, name) for name in self._key_order}  # ChatTemplates copies them
        if isinstance(self.content, list):
            values["content"] = "\n".join(part.text for part in self.content)
        if self.tool_calls == []:
            values.pop("tool_calls")
        return values


def _parsed_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call with its JSON arguments string parsed into an object (as chat
    templates expect, and vLLM passes them); raises ValueError for another shape."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ValueError("tool_calls entries must be {\"type\": \"function\", \"function\": {...}}")
    if not isinstance(function.get("name"), str):
        raise ValueError("tool_calls function must have a string name")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = limits.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"tool call {function['name']!r} arguments are not valid JSON: {exc}") from exc
    if not arguments:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {function['name']!r} arguments must be a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


def _check_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("tools entries must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
    if not isinstance(function.get("parameters", {}), dict):
        raise ValueError(f"tool {function['name']!r} parameters must be a JSON schema object")
    return tool


class ChatTemplateInput(BaseModel):
    """The fields a chat template is rendered from (chat completions and /tokenize)."""

    model_config = STRICT

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model goes on with the final message
    add_special_tokens: bool = False  # vLLM's: True adds the tokenizer's (a second BOS, usually)
    tools: list[dict[str, Any]] | None = None  # JSON schemas, passed to the template as sent
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents for the template
    chat_template: str | None = None  # a template, or the name of one of the model's
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if tools is None else [_check_tool(tool) for tool in tools]

    def conversation(self) -> Conversation:
        return Conversation(
            messages=[m.template_message() for m in self.messages], tools=self.tools, documents=self.documents,
            add_generation_prompt=self.add_generation_prompt, continue_final_message=self.continue_final_message,
            chat_template=self.chat_template, template_kwargs=dict(self.chat_template_kwargs or {}),
        )

    def chat_prompt(self, tokenizer: ModelTokenizer) -> Prompt:
        """The rendered conversation, encoded as apply_chat_template(tokenize=True) encodes it
        (no special tokens added unless add_special_tokens); raises ApiError (400). Blocks for
        up to the template timeout."""
        try:
            text = tokenizer.render_chat(self.conversation())
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), exc.param) from exc
        return Prompt(tokenizer.encode(text, self.add_special_tokens))


class NamedFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(ChatTemplateInput, GenerationRequest):
    model_config = GENERATION  # NOTE: not ChatTemplateInput's STRICT: unknown top-level fields are ignored

    max_completion_tokens: int | None = limit_field("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs")
    # None: "auto" with tools, "none" without (OpenAI's defaults); see tool_policy().
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: True (OpenAI's default)
    modalities: list[str] | None = None  # only ["text"]
    # Ignored, meaningless here: tags and storage for OpenAI's dashboard, its processing tiers,
    # its cache routing hint (prefix caching here needs none), its end-user id for abuse checks.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def asked_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().asked_max_tokens

    @property
    def default_max_tokens(self) -> None:
        return None  # as vLLM: up to the context left after the prompt

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def grammars_asked(self) -> list[tuple[str, StructuredOutput]]:
        schema = self.tool_policy().grammar_schema()
        asked = super().grammars_asked()
        if schema is None:
            return asked
        return [("tools", StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))), *asked]

    def tool_policy(self) -> ToolPolicy:
        """What tools and tool_choice ask of the output (NONE without tools)."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        functions = {tool["function"]["name"]: tool["function"] for tool in self.tools or ()}
        is_parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            return ToolPolicy(ToolChoiceMode.NAMED, functions, choice.function.name, is_parallel)
        return ToolPolicy(ToolChoiceMode(choice), functions, None, is_parallel)

    def check_supported(self) -> None:
        self._check_tool_choice()  # NOTE: first: the base's schema checks build the tools' grammar schema
        super().check_supported()
        if self.modalities is not None and self.modalities != ["text"]:
            raise ApiError(400, f"modalities {self.modalities} are not supported (text only)", "modalities")

    def _check_tool_choice(self) -> None:
        """tool_choice other than "none" needs tools; a named one, one of them; a forced call
        leaves no room for another grammar (response_format)."""
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise ApiError(400, "tool_choice needs tools: no tools were given", "tool_choice")
        policy = self.tool_policy()
        if policy.mode is ToolChoiceMode.NAMED and policy.named not in policy.functions:
            raise ApiError(400, f"tool_choice names function {policy.named!r}, which is not among the tools "
                                f"{sorted(policy.functions)}", "tool_choice")
        if policy.mode is ToolChoiceMode.REQUIRED and not policy.functions:
            raise ApiError(400, "tool_choice \"required\" needs at least one tool", "tool_choice")
        others = [param for param, _ in super().grammars_asked()]
        if policy.is_forced and others:
            raise ApiError(400, f"{others[0]} asks for a grammar and cannot be combined with a forced tool call "
                                "(tool_choice \"required\" or a named function)", others[0])

    def prompts(self, tokenizer: ModelTokenizer) -> list[Prompt]:
        return [self.chat_prompt(tokenizer)]


class TokenizeChatRequest(ChatTemplateInput):
    """POST /tokenize with messages (vLLM's TokenizeChatRequest)."""

    model: str | None = None
    return_token_strs: bool = False

    def prompt_ids(self, tokenizer: ModelTokenizer) -> list[int]:
        return self.chat_prompt(tokenizer).token_ids
