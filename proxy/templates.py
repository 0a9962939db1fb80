"""Chat templates: where a checkpoint's come from (as transformers 5 loads them), which one a
request gets, and rendering a conversation exactly as transformers' apply_chat_template(...,
tokenize=False) does, in the bounded sandbox of proxy.template_sandbox."""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from proxy.errors import ChatTemplateError
from proxy.template_sandbox import BoundedRenderer, compile_template, new_environment

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 save_pretrained: the default template
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # ... and the named others, NAME.jinja
DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"
# The variables apply_chat_template passes itself; chat_template_kwargs may not set them.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
# transformers copies a message's reasoning under each name (templates read one or another).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the final message
_MAX_COMPILED = 64  # compiled templates kept: the checkpoint's few plus recent per-request ones


def read_template_sources(model_dir: str | Path,
                          template_path: str | Path | None = None) -> str | dict[str, str] | None:
    """The chat template(s) transformers 5 would load from model_dir: a single template, a
    dict of named ones, or None. template_path (`--chat-template FILE`) replaces them all.
    Raises OSError for an unreadable file and ChatTemplateError for a malformed entry."""
    if template_path is not None:
        return Path(template_path).read_text(encoding="utf-8")
    model_dir = Path(model_dir)
    files = _template_files(model_dir)
    if files:
        return files[DEFAULT_TEMPLATE] if list(files) == [DEFAULT_TEMPLATE] else files
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    return _config_templates(config.get("chat_template"))


def _template_files(model_dir: Path) -> dict[str, str]:
    """chat_template.jinja as "default", additional_chat_templates/NAME.jinja as NAME; when any
    exists transformers ignores tokenizer_config.json's templates."""
    files = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        files[DEFAULT_TEMPLATE] = (model_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return files


def _config_templates(entry: Any) -> str | dict[str, str] | None:
    """tokenizer_config.json's "chat_template": a string, or a list of {"name", "template"}."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(e, dict) and {"name", "template"} <= e.keys() for e in entry):
        return {e["name"]: e["template"] for e in entry}
    raise ChatTemplateError("tokenizer_config.json chat_template must be a string or a list of "
                            "{\"name\", \"template\"} objects")


@dataclass
class Conversation:
    """What a chat request gives the template: messages as an OpenAI client sends them (dicts,
    text parts already joined), and the other apply_chat_template arguments."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a template's source, or the name of one of the model's
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


class ChatTemplates:
    """A checkpoint's chat template(s), compiled on first use, rendered within timeout_s; a
    request's own template is used only when is_request_template_trusted."""

    def __init__(self, sources: str | dict[str, str] | None, timeout_s: float,
                 is_request_template_trusted: bool = False) -> None:
        self.sources = sources
        self.is_request_template_trusted = is_request_template_trusted
        self._env = new_environment()
        self._renderer = BoundedRenderer(timeout_s)
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._compiled_lock = threading.Lock()  # renders run in worker threads

    def names(self) -> list[str]:
        return sorted(self.sources) if isinstance(self.sources, dict) else []

    def is_model_template(self, name_or_source: str) -> bool:
        """Whether a request's chat_template names (or repeats) one of the model's own."""
        if isinstance(self.sources, dict):
            return name_or_source in self.sources or name_or_source in self.sources.values()
        return name_or_source == self.sources

    def select(self, requested: str | None, has_tools: bool) -> str:
        """The template source for a request, chosen as transformers' get_chat_template does:
        a named one, else "tool_use" when tools were given, else "default"; a requested source
        that names none is used as given (if trusted). Raises ChatTemplateError when there is none."""
        if requested is not None and not self.is_request_template_trusted and not self.is_model_template(requested):
            raise ChatTemplateError("chat_template in requests is refused unless the proxy runs with "
                                    "--trust-request-chat-template (a template runs code)", "chat_template")
        if isinstance(self.sources, dict):
            if requested is not None:
                return self.sources.get(requested, requested)
            if has_tools and TOOL_USE_TEMPLATE in self.sources:
                return self.sources[TOOL_USE_TEMPLATE]
            if DEFAULT_TEMPLATE in self.sources:
                return self.sources[DEFAULT_TEMPLATE]
            raise ChatTemplateError(f"this model has several chat templates and no default; name one in "
                                    f"chat_template: {self.names()}")
        if requested is not None:
            return requested
        if self.sources is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions or start the proxy "
                                    "with --chat-template")
        return self.sources

    def render(self, conversation: Conversation, special_tokens: dict[str, str]) -> str:
        """The prompt text, as apply_chat_template(conversation, tokenize=False, **kwargs) with
        the tokenizer's special tokens; raises ChatTemplateError. Blocks for up to the timeout."""
        check_conversation(conversation)
        source = self.select(conversation.chat_template, conversation.tools is not None)
        template = self._compile(source)
        messages = _normalized_messages(conversation)
        final_text = _tag_final_message(messages, source) if conversation.continue_final_message else None
        variables = {**special_tokens, **conversation.template_kwargs, "messages": messages,
                     "tools": copy.deepcopy(conversation.tools), "documents": copy.deepcopy(conversation.documents),
                     "add_generation_prompt": conversation.add_generation_prompt}
        text = self._renderer.render(template, variables)
        return text if final_text is None else _cut_after_final_message(text, final_text)

    def _compile(self, source: str) -> jinja2.Template:
        with self._compiled_lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template
        template = compile_template(self._env, source)
        with self._compiled_lock:
            self._compiled[source] = template
            if len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        return template


def check_conversation(conversation: Conversation) -> None:
    """The argument checks apply_chat_template makes before rendering; raises ChatTemplateError."""
    if not conversation.messages:
        raise ChatTemplateError("cannot apply the chat template to an empty conversation")
    if conversation.continue_final_message and conversation.add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible: set "
                                "add_generation_prompt to false to continue the final message")
    reserved = sorted(set(conversation.template_kwargs) & set(RESERVED_VARIABLES))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {reserved}: use the request fields")


def _normalized_messages(conversation: Conversation) -> list[dict[str, Any]]:
    """Fresh copies as apply_chat_template makes them: keys whose value is None dropped, and a
    message's reasoning copied under the names templates read."""
    messages = [{k: copy.deepcopy(v) for k, v in m.items() if v is not None} for m in conversation.messages]
    return [_alias_reasoning(m) for m in messages]


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the final message's content (transformers' continue_final_message);
    returns the content. Raises ChatTemplateError as transformers raises ValueError."""
    final = messages[-1].get("content")
    if final is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue')
    if "content" not in source:
        raise ChatTemplateError('continue_final_message is set but "content" is not a field this chat template reads')
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message needs the final message's content as text")
    messages[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered text up to the end of the final message's content (its tag removed)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the "
                                "rendered chat: this chat template changes or drops it")
    tag_idx = text.rindex(tag)
    if text[tag_idx:tag_idx + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:tag_idx]
    return text[:tag_idx].rstrip()  # the template trimmed the space after the tag (and maybe the message's own)
