"""Text <-> token ids for the proxy (tokenizers, no torch), as transformers does it: the tokenizer
object transformers' AutoTokenizer builds for the checkpoint (its class may replace the
pre-tokenizer or post-processor tokenizer.json holds: Qwen2's does), prompts encoded with the
special tokens its post-processor adds (chat prompts without: the template writes them), the
special tokens chat templates see, incremental detokenizing that never splits a multi-byte
character, and stop strings."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders

from proxy.templates import ChatTemplates, Conversation, read_template_sources

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# The files AutoTokenizer builds a tokenizer from; their bytes (and transformers' version) key the cache.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json")
# Run in a child: transformers imports torch, which the proxy never loads. Offline: nothing is fetched.
_BUILD_TOKENIZER = """
import sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
sys.stdout.write(tokenizer.backend_tokenizer.to_str())
"""
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def transformers_tokenizer(model_dir: Path, timeout_s: float = 300.0) -> Tokenizer:
    """The tokenizers object transformers' AutoTokenizer builds for model_dir, built once in a
    child process and cached (PDSERVE_CACHE_DIR, else ~/.cache/pdserve) by the tokenizer files'
    bytes and transformers' version. Where transformers cannot build it (not installed, a slow-only
    tokenizer), tokenizer.json as it is, with a warning."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    digest = hashlib.sha256(str(version).encode())
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"\0"))
    cache = _cache_dir() / f"{digest.hexdigest()[:32]}.json"
    if cache.is_file():
        return Tokenizer.from_file(str(cache))
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # NOTE: first: a broken file fails here, plainly
    if version is None:
        logger.warning("transformers is not installed: tokenizing with %s/tokenizer.json as it is", model_dir)
        return raw
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        child = subprocess.run([sys.executable, "-c", _BUILD_TOKENIZER, str(model_dir)], capture_output=True,
                               text=True, timeout=timeout_s, env=env, check=True)
        built = Tokenizer.from_str(child.stdout)
    except Exception as exc:  # noqa: BLE001 - a failed child, or output tokenizers refuses: the file's own
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("transformers could not build the tokenizer of %s (%s); tokenizing with its tokenizer.json "
                       "as it is", model_dir, detail.strip().splitlines()[-1][:300] if detail.strip() else exc)
        return raw
    _write_atomically(cache, child.stdout)
    return built


def _cache_dir() -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "pdserve")
    return Path(base) / "tokenizers"


def _write_atomically(path: Path, text: str) -> None:
    """Best effort: a cache that cannot be written only costs the next start the child again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temp, path)
    except OSError as exc:
        logger.warning("could not cache the tokenizer in %s: %s", path.parent, exc)


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    templates: ChatTemplates
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: what transformers passes chat templates
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_dir(cls, model_dir: str | Path, template_timeout_s: float, chat_template_path: str | Path | None = None,
                 is_request_template_trusted: bool = False) -> ModelTokenizer:
        """Read the tokenizer files of model_dir (tokenizer.json, tokenizer_config.json, the chat
        templates, config.json, generation_config.json); chat_template_path replaces the model's
        templates. Raises OSError or ValueError for missing or malformed files."""
        model_dir = Path(model_dir)
        tokenizer = transformers_tokenizer(model_dir)
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        eos = gen_config.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            tokenizer=tokenizer,
            templates=ChatTemplates(read_template_sources(model_dir, chat_template_path), template_timeout_s,
                                    is_request_template_trusted),
            special_tokens=read_special_tokens(model_dir),
            eos_token_ids=eos_ids,
            vocab_size=config.get("vocab_size", tokenizer.get_vocab_size()),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
        )

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: what the tokenizer's post-processor adds (BOS for Llama-style
        tokenizers), as transformers' encode and tokenizer(text) and vLLM's completions do; chat
        prompts pass False (apply_chat_template's tokenize=True), their template writes them.
        Releases the GIL while it works: call it off the event loop for long texts."""
        # NOTE: encode_batch, not encode: the same ids, but encode holds the GIL throughout
        # (a 1 MB prompt stalled the event loop 1.5 s in a worker thread; ~4 us more per call).
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's vocabulary entry ("Ġhello", "<0xE4>"), as convert_ids_to_tokens gives."""
        return [self.tokenizer.id_to_token(i) or "" for i in token_ids]

    def render_chat(self, conversation: Conversation) -> str:
        """The chat prompt text as transformers renders it; raises ChatTemplateError. Blocks for
        up to the template timeout: call it off the event loop."""
        return self.templates.render(conversation, self.special_tokens)

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
        # NOTE: after another token, not alone: a SentencePiece decoder strips the leading space of
        # a text's first token ("▁def" alone is "def", but " def" where it follows text).
        anchor = self._anchor
        if anchor is None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        anchor_id, anchor_text = anchor
        text = self.tokenizer.decode([anchor_id, token_id], skip_special_tokens=False)
        return text.removeprefix(anchor_text).encode()

    @functools.cached_property
    def _anchor(self) -> tuple[int, str] | None:
        """A plain one-letter token and its text, decoded before a token to read that token's text
        in context."""
        anchor = next((i for i in map(self.tokenizer.token_to_id, "aeiostxAE") if i is not None), None)
        return None if anchor is None else (anchor, self.tokenizer.decode([anchor], skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it: the text when its bytes are whole characters,
        else OpenAI's "bytes:\\xNN..." form (so distinct partial tokens stay distinct)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def read_special_tokens(model_dir: str | Path) -> dict[str, str]:
    """The named special tokens transformers' apply_chat_template passes the template (its
    special_tokens_map): every "*_token" entry of tokenizer_config.json with a text (bos_token,
    eos_token, unk_token, pad_token, ... and model-specific ones such as image_token), plus a
    named extra_special_tokens dict. Without "added_tokens_decoder" there, a legacy
    special_tokens_map.json overrides the entries it has, as in transformers."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
        config = {**config, **_read_json(model_dir / "special_tokens_map.json")}
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    named = {**{k: v for k, v in config.items() if k.endswith("_token")}, **(extra if isinstance(extra, dict) else {})}
    return {name: text for name, value in named.items() if (text := _token_text(value)) is not None}


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


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    """A token entry's text: a string, or an AddedToken object's "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class TextOptions:
    """How a choice's token ids become its text (vLLM's fields, with vLLM's defaults)."""

    stops: list[str]
    skip_special_tokens: bool = True  # special tokens (EOS, chat markers, ...) left out of the text
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it
    tokens_as_ids: bool = False  # logprobs name each token "token_id:N" (vLLM's return_tokens_as_token_ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. A byte-level BPE token can end in
    the middle of a UTF-8 character; such a character is held back until it completes (text
    before it goes out at once).

    NOTE: not tokenizers' DecodeStream, though it is faster (4,000 tokens on SmolLM2's
    tokenizer: 1.46M tokens/s against 0.38M; 1.5x on a byte-fallback one): it holds back the
    whole characters a token carries before a split one (SmolLM2's "ĠÃ" in " über" sends
    nothing, then " ü"), and has no flush for a broken tail. 2.6 us a token is cheap enough."""

    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
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
        skip = self._skip_special_tokens
        prefix_text = self._tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset], skip)
        full_text = self._tokenizer.decode(self.token_ids[self._prefix_offset:], skip)
        return full_text[len(prefix_text):]


class StopChecker:
    """Finds stop strings in streamed text; holds back a possible stop string's beginning."""

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop  # the text sent ends with the stop string found
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.is_stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets is_stopped (and drops the rest) at a stop string."""
        if not self.stops:
            return text
        self._pending += text
        found = min(((i, -len(s)) for i, s in ((self._pending.find(s), s) for s in self.stops) if i >= 0),
                    default=None)
        if found is not None:  # the earliest stop string (the longest of those starting there)
            cut, minus_length = found
            self.is_stopped = True
            out, self._pending = self._pending[:cut - minus_length if self.include_stop else cut], ""
            return out
        if len(self._pending) <= self._hold:
            return ""
        out = self._pending[: len(self._pending) - self._hold]
        self._pending = self._pending[len(out):]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
