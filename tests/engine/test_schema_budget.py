"""The grammar budget (engine/schema_budget.py): what a pattern costs once its repetitions are
expanded, ambiguous unbounded repetition and too many open repetitions refused (in a schema's
patterns and in a whole-output regex), length bounds capped; the schemas a hostile
client sent (issue 54) refused at once, everyday ones not, and the engine checking before it
compiles."""

import pytest

from engine.protocol import StructuredKind, StructuredOutput
from engine.schema_budget import (
    MAX_GROUP_DEPTH,
    MAX_LENGTH_BOUND,
    MAX_OPEN_REPEATS,
    MAX_PATTERN_COST,
    MAX_SCHEMA_COST,
    SchemaTooCostly,
    check_pattern,
    check_schema,
    pattern_cost,
)

HOSTILE = ["(a|b){10007}", "^(a+)+$", "a{100000}", "[a-z]{1,200000}", "(a|b){5000}", "(a*b*)*", "(x{40}){60}",
           "a{" + "9" * 5000 + "}", "a{1," + "9" * 5000 + "}",  # counts past int()'s 4,300 digits
           "a{²}+a+" * 40]  # "²" is no count: a literal brace, and too many open repetitions
EVERYDAY = [r"^\d{4}-\d{2}-\d{2}$", r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$", r"([a-z]+\.)+[a-z]+",
            r"\d+(\.\d+)?", r"^(?:\+1)?[0-9]{10}$", "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$", r"[\]\[(){}]+"]


@pytest.mark.parametrize(("pattern", "cost", "nested"), [
    ("(a|b){10}", 20, False), ("a+", 1, False), ("^(a+)+$", 1, True), ("(ab){3}c", 7, False),
    ("[a-z]{2,5}", 5, False), ("(?:ab)+", 2, False), ("(a|b+)+", 2, True), (r"\{3\}", 3, False),
])
def test_pattern_costs(pattern, cost, nested):
    assert pattern_cost(pattern) == (cost, nested)


@pytest.mark.parametrize("pattern", HOSTILE)
def test_the_hostile_patterns_are_refused(pattern):
    with pytest.raises(SchemaTooCostly, match="schema.properties.s.pattern"):
        check_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})


def test_the_patterns_of_one_schema_are_budgeted_together():
    """Each pattern under its own limit, many of them past the schema's."""
    pattern = f"[a-z]{{{MAX_PATTERN_COST}}}"
    count = MAX_SCHEMA_COST // MAX_PATTERN_COST
    check_schema({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": pattern}
                                                   for i in range(count)}})
    with pytest.raises(SchemaTooCostly, match=f"together spell out {(count + 1) * MAX_PATTERN_COST} characters"):
        check_schema({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": pattern}
                                                       for i in range(count + 1)}})


def test_a_count_in_other_digits_is_no_count():
    """'²' is a digit to str.isdigit but not to int(): a{²} is the literal text, not a repetition
    (a ValueError out of the proxy's validation was a 500)."""
    assert check_pattern("a{\u00b2}", "the regex") == 4 and check_pattern("a{1,\u00b2}", "the regex") == 6


@pytest.mark.parametrize("group", ["(", "(?:"])
def test_groups_nested_past_the_limit_are_refused_without_recursing_into_them(group):
    """Deeper than Python's recursion limit, closed or not: a 400, not a RecursionError (a 500)."""
    assert check_pattern(group * MAX_GROUP_DEPTH + "a" + ")" * MAX_GROUP_DEPTH, "the regex") == 1
    for pattern in (group * (MAX_GROUP_DEPTH + 1) + "a" + ")" * (MAX_GROUP_DEPTH + 1), group * 100_000):
        with pytest.raises(SchemaTooCostly, match=f"nests groups more than {MAX_GROUP_DEPTH} deep"):
            check_pattern(pattern, "the regex")


@pytest.mark.parametrize("pattern", EVERYDAY)
def test_everyday_patterns_pass(pattern):
    check_schema({"type": "string", "pattern": pattern})
    assert pattern_cost(pattern)[0] <= MAX_PATTERN_COST


@pytest.mark.parametrize("unit", ["a*", "(a|b)*", "[a-z]+", "a?", "x{2,}", "b*?"])
def test_a_pattern_of_many_open_repetitions_is_refused_as_a_regex_and_in_a_schema(unit):
    """a*a*a*...: cheap by the atom count, but its overlapping repetitions took minutes to compile."""
    check_pattern(unit * MAX_OPEN_REPEATS, "the regex")
    with pytest.raises(SchemaTooCostly, match=f"the regex .* has {MAX_OPEN_REPEATS + 1} repetitions of open count"):
        check_pattern(unit * (MAX_OPEN_REPEATS + 1), "the regex")
    with pytest.raises(SchemaTooCostly, match="schema.pattern"):
        check_schema({"type": "string", "pattern": unit * (MAX_OPEN_REPEATS + 1)})
    check_pattern("a{0,3}" * (MAX_OPEN_REPEATS + 1), "the regex")  # bounded: xgrammar keeps the count


@pytest.mark.parametrize("pattern", HOSTILE)
def test_the_hostile_patterns_are_refused_as_a_whole_regex(pattern):
    with pytest.raises(SchemaTooCostly, match="the regex"):
        check_pattern(pattern, "the regex")


def test_length_bounds_and_pattern_properties_are_looked_at_everywhere():
    check_schema({"type": "array", "maxItems": MAX_LENGTH_BOUND, "items": {"type": "string", "maxLength": 200}})
    with pytest.raises(SchemaTooCostly, match=r"schema\.items\.maxLength is 200000"):
        check_schema({"type": "array", "items": {"type": "string", "maxLength": 200_000}})
    with pytest.raises(SchemaTooCostly, match=r"schema\.\$defs\.x\.patternProperties key"):
        check_schema({"$defs": {"x": {"patternProperties": {"(a|b){3000}": {"type": "string"}}}}})


def test_the_engine_refuses_before_compiling(tiny_model_dir):
    """Grammars.compile checks the budget first: a ValueError naming the request, at once."""
    from engine.grammar import Grammars

    grammars = Grammars(str(tiny_model_dir), 2048, (0,))
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "string", "pattern": "(a|b){10007}"}')
    with pytest.raises(ValueError, match="request r1: json_schema is not supported: .*spells out 20014"):
        grammars.compile("r1", spec)
    assert grammars.num_compiled == 0
    assert grammars.is_ready(spec)  # refused, and remembered: a repeat costs a lookup
    with pytest.raises(ValueError, match="request r2: json_schema is not supported: .*spells out 20014"):
        grammars.compile("r2", spec)
