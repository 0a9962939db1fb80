"""Structured output: grammars compiled with xgrammar (LRU-cached per engine) and one matcher
per request, which masks the request's logits row to the tokens the grammar allows. A grammar
is a JSON schema, any JSON object, a regex, a list of choices or an EBNF grammar (StructuredKind).

xgrammar runs on the CPU: a grammar is compiled once against the model's tokenizer (the vocab
of the model, padding rows included: they are never allowed), and a matcher then fills a packed
bitmask ([rows, ceil(vocab / 32)] int32) in C++ for each step. xgrammar and transformers are
imported on the first structured request: a node that never sees one starts without them.

A server does not compile on its step loop: it asks is_ready, has build run on a worker thread
(xgrammar releases the GIL while it works) and hands the result to store, or the refusal to
refuse; compile does all of it inline, for offline use.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from engine.protocol import STRUCTURED_FIELDS, StructuredKind, StructuredOutput
from engine.sampling_rules import SamplingError, check_structured
from engine.schema_budget import SchemaRefused, check_pattern, check_schema

if TYPE_CHECKING:
    import xgrammar

GrammarKey = StructuredOutput  # NOTE: frozen, hashable, equal field by field

logger = logging.getLogger(__name__)

_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# NOTE: any whitespace is allowed between JSON tokens (the model may pretty-print), but a run of
# it is bounded: small models left free are known to emit newlines until max_tokens. 32
# characters fit a newline plus the indent of a pretty-printed object 7 levels deep.
_MAX_WHITESPACE_RUN = 32
# What xgrammar's messages open with: "[13:08:18] /project/cpp/regex_converter.cc:94: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class RequestGrammar:
    """One request's grammar state: which tokens may come next, given those accepted so far."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a bit per token, 1: allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past token_id; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted: the request ends."""
        return self._matcher.is_terminated()


class GrammarRefused(ValueError):
    """A spec no grammar is made from (not supported, or past the budget); the message names the
    part, not the request."""


class Grammars:
    """Compiles StructuredOutput specs for one model's tokenizer and makes per-request matchers.
    The tokenizer is loaded on the first structured request (engines that never see one pay
    nothing). Compiled grammars are kept in an LRU of cache_size entries keyed by the spec, and
    the specs refused (with why) in another, so a client repeating one costs a lookup.

    Thread-safety: build may run on any thread (several at once); everything else belongs to
    the thread that owns the engine."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 64) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[GrammarKey, str] = OrderedDict()
        self._live: weakref.WeakSet[RequestGrammar] = weakref.WeakSet()
        self._compiler_lock = threading.Lock()

    @property
    def num_compiled(self) -> int:
        """Compiled grammars in the LRU (at most cache_size)."""
        return len(self._compiled)

    @property
    def num_live_matchers(self) -> int:
        """Matchers still referenced (by a request); 0 when no structured request is here."""
        return len(self._live)

    def new_matcher(self, request_id: str, spec: StructuredOutput, output_token_ids: list[int]) -> RequestGrammar:
        """A matcher for spec that has accepted output_token_ids (the tokens a request arrives
        with: a first token sampled on a prefill node, or more). Raises ValueError naming the
        request when the schema cannot be compiled or a token breaks the grammar."""
        import xgrammar

        grammar = RequestGrammar(xgrammar.GrammarMatcher(self.compile(request_id, spec)))
        for idx, token_id in enumerate(output_token_ids):
            if grammar.is_terminated or not grammar.accept(token_id):
                raise ValueError(f"request {request_id}: output token {idx} (id {token_id}) does not follow "
                                 f"its {spec.kind.value} grammar")
        self._live.add(grammar)
        return grammar

    @staticmethod
    def key(spec: StructuredOutput) -> GrammarKey:
        return spec

    def is_ready(self, spec: StructuredOutput) -> bool:
        """Whether compile(spec) answers at once (compiled, or refused, before)."""
        key = self.key(spec)
        return key in self._compiled or key in self._refused

    def compile(self, request_id: str, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of spec (cached). Raises ValueError naming the request when
        xgrammar refuses the schema (an unsupported keyword, a bad regex pattern, ...) or it is
        past the budget (engine.schema_budget), now or before."""
        key = self.key(spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        why = self._refused.get(key)
        if why is None:
            try:
                compiled = self.build(spec)
            except GrammarRefused as exc:
                why = str(exc)
                self.refuse(spec, why)
        if why is not None:
            raise ValueError(f"request {request_id}: {why}")
        self.store(spec, compiled)
        return compiled

    def build(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """Compile spec (no cache), after the checks the proxy made (engine.protocol's bounds, the
        budget of engine.schema_budget). Raises GrammarRefused naming the spec's field. Safe on
        any thread."""
        field = STRUCTURED_FIELDS.get(spec.kind, "json_schema")
        what = f"{field} is not supported" if field == "json_schema" else f"the {field} cannot be enforced"
        try:
            check_structured(spec)
            grammar = _grammar_of(spec)
            return self._get_compiler().compile_grammar(grammar)
        except (SamplingError, SchemaRefused, json.JSONDecodeError, RecursionError) as exc:  # (nested too deep)
            raise GrammarRefused(f"{what}: {exc}") from None
        except RuntimeError as exc:  # xgrammar reports every refusal of a grammar this way
            lines = str(exc).strip().splitlines()
            message = _XGRAMMAR_PREFIX.sub("", lines[-1]) if lines else type(exc).__name__
            raise GrammarRefused(f"{what}: {message}") from None

    def store(self, spec: StructuredOutput, compiled: xgrammar.CompiledGrammar) -> None:
        """Keep a grammar build made (on another thread) for the requests that ask for it (a
        refusal of spec is forgotten: a compile refused past its budget may finish later)."""
        self._refused.pop(self.key(spec), None)
        self._remember(self._compiled, self.key(spec), compiled)

    def prepare(self) -> None:
        """Load the tokenizer and make the compiler now (once; safe on any thread): the first
        compile's setup, which is not the schema's cost."""
        self._get_compiler()

    def refuse(self, spec: StructuredOutput, why: str) -> None:
        """Refuse spec from now on with why (a build refused it, or took past its budget)."""
        self._remember(self._refused, self.key(spec), why)

    def _remember(self, lru: OrderedDict, key: GrammarKey, value) -> None:
        lru[key] = value
        lru.move_to_end(key)
        if len(lru) > self.cache_size:
            lru.popitem(last=False)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            return self._compiler or self._make_compiler()

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as exc:
            raise ValueError(f"structured output needs the model's tokenizer in {self.model_dir}: {exc}") from exc
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None)
        # One thread per compile: a node compiles on its own worker threads (node.grammar_gate),
        # beside the model's.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        logger.info("grammar compiler ready for %s (vocab %d)", self.model_dir, self.vocab_size)
        return self._compiler


def _grammar_of(spec: StructuredOutput) -> xgrammar.Grammar:
    """spec (checked by check_structured) as an xgrammar Grammar; raises SchemaRefused past the
    budget, RuntimeError (from xgrammar) for text it cannot parse."""
    import xgrammar

    if spec.kind is StructuredKind.REGEX:
        check_pattern(spec.regex, "the regex")
        return xgrammar.Grammar.from_regex(spec.regex)
    if spec.kind is StructuredKind.CHOICE:
        return xgrammar.Grammar.from_ebnf(choices_ebnf(spec.choices))
    if spec.kind is StructuredKind.EBNF:
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    schema = spec.json_schema if spec.kind is StructuredKind.JSON_SCHEMA else _ANY_OBJECT_SCHEMA
    check_schema(json.loads(schema))
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=_MAX_WHITESPACE_RUN,
                                                strict_mode=spec.kind is StructuredKind.JSON_SCHEMA)
    return xgrammar.Grammar.from_ebnf(_without_raw_control_chars(str(grammar)))


def choices_ebnf(choices: tuple[str, ...]) -> str:
    """The EBNF grammar whose texts are exactly choices: root ::= "a" | "b" ... (each a string
    literal, its backslashes, quotes and control characters escaped). Raises SchemaRefused for
    a choice with U+0000, which xgrammar's literals cannot hold."""
    if any("\0" in choice for choice in choices):
        raise SchemaRefused("a choice holds U+0000, which the grammar cannot match")
    return "root ::= " + " | ".join(f'"{_ebnf_escaped(choice)}"' for choice in choices)


def _ebnf_escaped(text: str) -> str:
    # NOTE: \uHHHH takes exactly four digits (\xHH takes as many as follow: "\x00b" is U+000B).
    return "".join("\\" + char if char in '"\\' else f"\\u{ord(char):04x}" if ord(char) < 0x20 or char == "\x7f"
                   else char for char in text)


def _without_raw_control_chars(ebnf: str) -> str:
    """The grammar with JSON's rule for string characters restored where xgrammar drops it.

    NOTE: xgrammar 0.2.8 writes the characters of a string with maxLength/minLength as a class
    that excludes only the quote, backslash, CR and LF, so raw control characters pass
    (measured: the tiny model put U+000E inside a string, which strict JSON parsers refuse).
    JSON forbids U+0000..U+001F unescaped, as xgrammar's own unbounded string rule does. A
    no-op where that class does not occur."""
    return ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')


def mask_logits(logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
    """Set logits[row, t] to -inf (in place) for every token t that grammars[row] does not
    allow next; rows without a grammar are left as they are. logits: [len(grammars), vocab]."""
    import xgrammar

    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(grammars), logits.shape[-1])  # [rows, ceil(vocab / 32)] int32
    for row in rows:
        grammars[row].fill_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows)


def warm_up_masking(vocab_size: int, device: str) -> None:
    """Mask logits of this device with an all-allowed bitmask, as the sampler masks them (float32:
    a grammar's row is never plain greedy, so the sampler's logits are float32), one row and two:
    xgrammar's one-time costs of masking (on CUDA, the compiles of its Triton kernel) paid before
    serving instead of on the step loop of the first structured requests. Leaves nothing behind."""
    import xgrammar

    for num_rows in (1, 2):
        logits = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        bitmask = xgrammar.allocate_token_bitmask(num_rows, vocab_size)  # every token allowed
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(device), vocab_size=vocab_size,
                                             indices=list(range(num_rows)))
        if not bool((logits == 0).all()):
            raise RuntimeError(f"xgrammar's masking on {device} changed logits an all-allowed bitmask keeps")
