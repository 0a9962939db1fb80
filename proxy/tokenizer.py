"""Text <-> token ids for the proxy (tokenizers + jinja2, no torch): chat templates, incremental
detokenizing that never splits a multi-byte character, and stop strings."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from tokenizers import Tokenizer, decoders

_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_position_embeddings: int
    _template: jinja2.Template | None = field(default=None, repr=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelTokenizer:
        model_dir = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        eos = gen_config.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        result = cls(
            tokenizer=tokenizer,
            chat_template=tok_config.get("chat_template"),
            bos_token=_token_text(tok_config.get("bos_token")),
            eos_token=_token_text(tok_config.get("eos_token")),
            eos_token_ids=eos_ids,
            vocab_size=config.get("vocab_size", tokenizer.get_vocab_size()),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
        )
        if result.chat_template:
            env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=False, autoescape=False)
            env.globals["raise_exception"] = _raise_template_error
            result._template = env.from_string(result.chat_template)
        return result

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may hold part of a character)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel) and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        match = _BYTE_FALLBACK_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it: the text when its bytes are whole characters,
        else OpenAI's "bytes:\\xNN..." form (so distinct partial tokens stay distinct)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Raises ValueError when the model has no template or the template rejects the input."""
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return self.encode(text)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = list(printable)
    num_extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + num_extra)
            num_extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. A byte-level BPE token can end in
    the middle of a UTF-8 character; such a character is held back until it completes (text
    before it goes out at once)."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        # NOTE: decoding a window [prefix, end) rather than one token keeps the tokenizer's
        # context (leading spaces, merged bytes); text before read_offset has gone out already.
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_sent_chars = 0  # chars past read_offset already sent (an incomplete tail follows)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        new_text = self._new_text()
        complete = new_text.rstrip(_REPLACEMENT)
        if complete != new_text:  # ends inside a character: send what precedes it, hold the rest
            out = complete[self._num_sent_chars:]
            self._num_sent_chars = max(self._num_sent_chars, len(complete))
            return out
        out = new_text[self._num_sent_chars:]
        if new_text:
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            self._num_sent_chars = 0
        return out

    def flush(self) -> str:
        """At the end: whatever is still held back (a truly broken character shows as U+FFFD)."""
        out = self._new_text()[self._num_sent_chars:]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._num_sent_chars = 0
        return out

    def _new_text(self) -> str:
        prefix_text = self._tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self.token_ids[self._prefix_offset:])
        return full_text[len(prefix_text):]


class StopChecker:
    """Finds stop strings in streamed text; holds back a possible stop string's beginning."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.is_stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets is_stopped (and drops the rest) at a stop string."""
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.is_stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        if len(self._pending) <= self._hold:
            return ""
        out = self._pending[: len(self._pending) - self._hold]
        self._pending = self._pending[len(out):]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
