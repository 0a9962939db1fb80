"""Structured output beyond JSON (vLLM's guided_regex, guided_choice, guided_grammar): the tiny
random model's text, greedy and sampled, matches the regex as a whole, is exactly one of the
choices (quotes, backslashes, newlines and non-ASCII among them), and is derived by the EBNF
grammar; each ends with eos. A regex or grammar xgrammar cannot parse, and one past the budget,
is a ValueError naming the request at admission; a decode node's matcher takes the tokens a
request arrives with."""

from __future__ import annotations

import re

import pytest

from engine.engine import LLMEngine
from engine.grammar import GrammarRefused, Grammars
from engine.protocol import StructuredKind, StructuredOutput
from engine.sampling_params import SamplingParams
from engine.sampling_rules import MAX_GRAMMAR_BYTES, SamplingError
from tests.engine.run_requests import EOS_IDS, PROMPT, run_to_end

MAX_TOKENS = 96  # every grammar here is complete well within it
SEEDS = range(8)

REGEXES = [r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", r"\d{4}-\d{2}-\d{2}", r"(yes|no), because [A-Z][a-z ]{2,20}\."]
CHOICES = ('say "yes"', "back\\slash", "two\nlines", "peut-être", "no")
# Arithmetic in parentheses, nested once at most; ARITHMETIC is the same language as a regex.
EBNF = """
root ::= "(" term (op term){0,3} ")"
op ::= " + " | " * "
term ::= [0-9] | "(" [0-9] (" + " [0-9]){0,2} ")"
"""
_TERM = r"([0-9]|\([0-9]( \+ [0-9]){0,2}\))"
ARITHMETIC = re.compile(rf"\({_TERM}( [+*] {_TERM}){{0,3}}\)")


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput(StructuredKind.REGEX, regex=pattern)


def choice(*choices: str) -> StructuredOutput:
    return StructuredOutput(StructuredKind.CHOICE, choices=choices)


def ebnf(grammar: str) -> StructuredOutput:
    return StructuredOutput(StructuredKind.EBNF, grammar=grammar)


def texts(engine: LLMEngine, tokenizer, spec: StructuredOutput, seeds=SEEDS) -> list[str]:
    """The texts of a greedy request and one sampled request per seed, run together, each
    checked to end with eos (finish "stop"); the engine then holds nothing."""
    requests = {"greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=spec)}
    requests |= {f"s{seed}": SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=spec)
                 for seed in seeds}
    results = run_to_end(engine, requests)
    for request_id, (ids, reason) in results.items():
        assert reason == "stop" and ids[-1] in EOS_IDS, (request_id, tokenizer.decode(ids))
    return [tokenizer.decode(ids[:-1]) for ids, _ in results.values()]


@pytest.mark.parametrize("pattern", REGEXES)
def test_the_text_matches_the_regex_as_a_whole(engine, tokenizer, pattern):
    outputs = texts(engine, tokenizer, regex(pattern))
    assert all(re.fullmatch(pattern, text) for text in outputs), outputs
    assert len(set(outputs)) > 1  # sampled texts differ: the grammar masks, it does not dictate


def test_the_text_is_exactly_one_of_the_choices(engine, tokenizer):
    outputs = texts(engine, tokenizer, choice(*CHOICES), seeds=range(16))
    assert set(outputs) <= set(CHOICES), outputs
    assert len(set(outputs)) > 1, outputs


def test_one_choice_is_the_only_text(engine, tokenizer):
    assert set(texts(engine, tokenizer, choice("only this"), seeds=range(2))) == {"only this"}


def test_the_text_is_derived_by_the_ebnf_grammar(engine, tokenizer):
    outputs = texts(engine, tokenizer, ebnf(EBNF))
    assert all(ARITHMETIC.fullmatch(text) for text in outputs), outputs
    for text in outputs:  # and it is arithmetic Python evaluates
        assert isinstance(eval(text, {"__builtins__": {}}), int)  # noqa: S307 -- matched ARITHMETIC above


def test_a_decode_nodes_matcher_takes_the_tokens_the_request_arrives_with(engine, tokenizer):
    prefix = tokenizer.encode("peut")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS, structured=choice(*CHOICES))
    engine.add_request("cont", PROMPT, params, output_token_ids=prefix)
    tokens = []
    while engine.has_unfinished():
        tokens += [t.token_id for out in engine.step() for t in out.new_tokens]
    assert tokenizer.decode(prefix + tokens[:-1]) == "peut-être"
    with pytest.raises(ValueError, match=r"request bad: output token 0 .* does not follow its choice grammar"):
        engine.add_request("bad", PROMPT, params, output_token_ids=tokenizer.encode("maybe"))
    engine.check_leaks()


@pytest.mark.parametrize("spec, match", [
    (regex("(("), "the regex cannot be enforced: Regex parsing error at position 3"),
    (regex("(a+)+b"), "the regex cannot be enforced: .*repeats without bound"),
    (regex("(a|b){10007}"), "the regex cannot be enforced: .*spells out 20014 characters"),
    (regex("a*" * 40), "the regex cannot be enforced: .*40 repetitions of open count"),
    (ebnf('root ::= "a" undefined'), 'the grammar cannot be enforced: .*Rule "undefined" is not defined'),
    (ebnf('start ::= "a"'), 'the grammar cannot be enforced: .*root rule with name "root" is not found'),
    (choice("a\0b"), "the choices cannot be enforced: .*U\\+0000"),
])
def test_a_grammar_the_library_refuses_or_past_the_budget_is_a_value_error_at_admission(engine, spec, match):
    with pytest.raises(ValueError, match=f"request r: {match}"):
        engine.add_request("r", PROMPT, SamplingParams(structured=spec))
    assert engine.grammars.is_ready(spec)  # refused, and remembered
    engine.check_leaks()


def test_a_grammar_past_its_size_is_refused_before_it_compiles(engine):
    spec = ebnf("root ::= " + " | ".join(['"abcdefgh"'] * (MAX_GRAMMAR_BYTES // 11 + 1)))
    with pytest.raises(SamplingError, match=f"structured.grammar has {len(spec.grammar)} bytes; the limit is "
                                            f"{MAX_GRAMMAR_BYTES}"):
        SamplingParams(structured=spec)
    with pytest.raises(GrammarRefused, match=f"limit is {MAX_GRAMMAR_BYTES}"):
        engine.grammars.build(spec)  # what a node's grammar threads run, before admission


def test_each_choice_and_nothing_else_completes_the_choice_grammar(tiny_model_dir):
    """Quotes, backslashes, control characters and non-ASCII text are taken literally."""
    import xgrammar

    compiled = Grammars(str(tiny_model_dir), 2048, EOS_IDS).compile("r", choice(*CHOICES, "tab\there\x7f"))
    for text in (*CHOICES, "tab\there\x7f"):
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(text) and matcher.accept_token(EOS_IDS[0]) and matcher.is_terminated(), text
    for text in ('say \\"yes\\"', "back\\\\slash", "two\\nlines", "n", "noo", "peut-etre"):
        matcher = xgrammar.GrammarMatcher(compiled)
        assert not (matcher.accept_string(text) and matcher.accept_token(EOS_IDS[0])), text


def test_each_kind_and_text_is_its_own_cache_entry(tiny_model_dir):
    grammars = Grammars(str(tiny_model_dir), 2048, EOS_IDS)
    first = grammars.compile("r", choice("a", "b"))
    assert grammars.compile("r", choice("a", "b")) is first
    grammars.compile("r", choice("b", "a"))
    grammars.compile("r", regex("a|b"))
    grammars.compile("r", ebnf('root ::= "a" | "b"'))
    assert grammars.num_compiled == 4
