"""A cheap look at a JSON schema before a node compiles it into a grammar: the parts whose cost a
client controls and a grammar pays for in full (regex repetition counts, nested unbounded
repetition, length bounds) are measured here, and a schema past the budget is a 400 before any
node is asked (a 150-byte `"pattern": "(a|b){10007}"` held a node's loop for tens of seconds);
the engine checks again before it compiles. Torch-free: the proxy imports it.

A pattern's cost is the number of atoms it spells out once its bounded repetitions are expanded
(`(a|b){10}` costs 20, `a+` 1); `(a+)+`, an unbounded repetition of something unbounded, is refused
outright, and so is a pattern of more than MAX_OPEN_REPEATS repetitions of open count (*, +, ?,
{n,}), which overlap: `a*` 200 times in a row took 1 s to compile, 1000 times over ten minutes. The
patterns of one schema together may cost MAX_SCHEMA_COST (twenty patterns at the single-pattern
limit took 4.2 s to turn into a grammar here). A whole-output regex (vLLM's guided_regex) is
checked as one pattern (check_pattern). Length bounds (minLength,
maxLength, minItems, maxItems, minProperties, maxProperties) are capped like a pattern. A $ref
outside the schema is refused in the same walk. What passes is still compiled under a time budget
(node.grammar_gate).
"""

from __future__ import annotations

from typing import Any

MAX_PATTERN_COST = 2000
MAX_SCHEMA_COST = 10_000
MAX_LENGTH_BOUND = 10_000
# NOTE: 64 overlapping repetitions (a*a*..., (a|b)*(a|b)*...) took about 1 s to compile on a 49k
# vocab, 32 about 0.2 s; everyday patterns have a handful.
MAX_OPEN_REPEATS = 32
# Groups inside groups: everyday patterns nest a few deep; the scan below and the grammar library
# recurse once per level.
MAX_GROUP_DEPTH = 64
_LENGTH_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


class SchemaRefused(ValueError):
    """A schema no grammar is made from; the message names the part."""


class SchemaTooCostly(SchemaRefused):
    """The schema is past the grammar budget; the message names the part and the limit."""


class ExternalReference(SchemaRefused):
    """A $ref outside the schema (a URL, a file): nothing is fetched, and a grammar made without
    the parts it names would be wrong."""


def check_schema(schema: Any) -> None:
    """Raise ExternalReference or SchemaTooCostly for the first part of schema that is one (see
    the module), in one walk over it."""
    total = _walk(schema, "schema", 0)
    if total > MAX_SCHEMA_COST:
        raise SchemaTooCostly(f"the schema's patterns together spell out {total} characters once their repetitions "
                              f"are expanded; a grammar allows at most {MAX_SCHEMA_COST}")


def _walk(schema: Any, path: str, total: int) -> int:
    """total plus the cost of schema's patterns; raises at the first part refused on its own."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            where = f"{path}.{key}"
            if key == "$ref" and isinstance(value, str) and not (value == "#" or value.startswith("#/")):
                raise ExternalReference(f"{where} {value[:200]!r} points outside the schema; only local references "
                                        "(\"#/...\") are supported, nothing is fetched")
            if key == "pattern" and isinstance(value, str):
                total += check_pattern(value, where)
            elif key == "patternProperties" and isinstance(value, dict):
                for pattern in value:
                    total += check_pattern(pattern, f"{where} key")
            elif key in _LENGTH_KEYWORDS and isinstance(value, int) and value > MAX_LENGTH_BOUND:
                raise SchemaTooCostly(f"{where} is {value}; a grammar allows at most {MAX_LENGTH_BOUND}")
            total = _walk(value, where, total)
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            total = _walk(value, f"{path}[{index}]", total)
    return total


def check_pattern(pattern: str, where: str) -> int:
    """The cost of pattern (a regex; where names it in messages); raises SchemaTooCostly when it
    is refused on its own (see the module)."""
    scan = _Scan(pattern)
    cost, _, is_nested = scan.alternatives()
    if scan.is_too_deep:
        raise SchemaTooCostly(f"{where} {pattern[:60]!r} nests groups more than {MAX_GROUP_DEPTH} deep")
    if scan.num_open_repeats > MAX_OPEN_REPEATS:
        raise SchemaTooCostly(f"{where} {pattern[:60]!r} has {scan.num_open_repeats} repetitions of open count "
                              f"(*, +, ?, {{n,}}); a grammar allows at most {MAX_OPEN_REPEATS}")
    if is_nested:
        raise SchemaTooCostly(f"{where} {pattern[:60]!r} repeats without bound something that itself repeats "
                              "without bound (as (a+)+); write it with one repetition")
    if cost > MAX_PATTERN_COST:
        raise SchemaTooCostly(f"{where} {pattern[:60]!r} spells out {cost} characters once its repetitions are "
                              f"expanded; a grammar allows at most {MAX_PATTERN_COST}")
    return cost


def pattern_cost(pattern: str) -> tuple[int, bool]:
    """(atoms spelled out with bounded repetitions expanded, whether an unbounded repetition
    applies to something already unbounded). A pattern the scan cannot follow (unbalanced
    parentheses) costs what it scanned: the grammar library refuses it on its own, as it does
    groups nested more than MAX_GROUP_DEPTH deep, past which the scan does not go."""
    parser = _Scan(pattern)
    cost, _, nested = parser.alternatives()
    return cost, nested


def _count(digits: str) -> int:
    """A repetition count; one of more than 9 digits is read as 10**9, past any budget (int() of
    over 4,300 digits raises ValueError)."""
    digits = digits.strip()
    return int(digits) if len(digits) <= 9 else 10**9


class _Scan:
    """A left-to-right scan of a regex. Each part gives (cost, is_loose, nested): is_loose when
    every element of it repeats without bound (so an unbounded repetition of it is ambiguous, as
    (a+)+ or (a*b*)*; ([a-z]+\\.)+ is not: its dot is met once per round), nested when such an
    ambiguous repetition occurs."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.num_open_repeats = 0  # quantifiers *, +, ? and {n,} met so far
        self.depth = 0  # groups open around the scan
        self.is_too_deep = False  # a group nested past MAX_GROUP_DEPTH: the scan stopped there

    def alternatives(self) -> tuple[int, bool, bool]:
        """Branches up to a closing parenthesis or the end: loose when any branch is."""
        cost, loose, nested = self.sequence()
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            c, lo, n = self.sequence()
            cost, loose, nested = cost + c, loose or lo, nested or n
        return cost, loose, nested

    def sequence(self) -> tuple[int, bool, bool]:
        cost, loose, nested, elements = 0, True, False, 0
        text = self.text
        while self.i < len(text) and text[self.i] not in "|)":
            start = self.i
            atom_cost, atom_loose, atom_nested = self.atom()
            low, high = self.quantifier()
            if atom_cost == 0 and self.i == start + 1:
                continue  # an anchor (^, $): neither cost nor element
            unbounded = high is None
            nested = nested or atom_nested or (unbounded and atom_loose)
            cost += atom_cost * max(1, high if high is not None else low)
            loose = loose and (unbounded or atom_loose)
            elements += 1
        return cost, loose and elements > 0, nested

    def atom(self) -> tuple[int, bool, bool]:
        text, i = self.text, self.i
        char = text[i]
        if char == "(":
            if self.depth == MAX_GROUP_DEPTH:
                self.is_too_deep, self.i = True, len(text)
                return 0, False, False
            self.i = i + 1
            if text.startswith("?", self.i):  # (?:...), (?=...), (?<name>...): skip the group's flags
                end = self.i + 1
                while end < len(text) and text[end] not in ":=!>" and text[end] != ")":
                    end += 1
                self.i = min(end + 1, len(text))
            self.depth += 1
            result = self.alternatives()
            self.depth -= 1
            if self.i < len(text) and text[self.i] == ")":
                self.i += 1
            return result
        if char == "[":
            end = i + 1
            if end < len(text) and text[end] == "^":
                end += 1
            if end < len(text) and text[end] == "]":
                end += 1
            while end < len(text) and text[end] != "]":
                end += 2 if text[end] == "\\" else 1
            self.i = end + 1
            return 1, False, False
        if char == "\\":
            self.i = i + 2
            return 1, False, False
        self.i = i + 1
        return (0 if char in "^$" else 1), False, False

    def quantifier(self) -> tuple[int, int | None]:
        """(low, high) of the repetition after an atom ((1, 1): none; high None: unbounded)."""
        text, i = self.text, self.i
        if i >= len(text):
            return 1, 1
        char = text[i]
        bounds: tuple[int, int | None] | None = None
        if char == "*":
            bounds, self.i = (0, None), i + 1
        elif char == "+":
            bounds, self.i = (1, None), i + 1
        elif char == "?":
            bounds, self.i = (0, 1), i + 1
        elif char == "{":
            end = text.find("}", i)
            inside = text[i + 1 : end] if end > 0 else ""
            low, _, high = inside.partition(",")
            # NOTE: isdecimal, not isdigit: int() refuses digits such as "²", which isdigit takes
            if low.strip().isdecimal() and (not high.strip() or high.strip().isdecimal()):
                low_n = _count(low)
                high_n = _count(high) if high.strip() else (None if "," in inside else low_n)
                bounds, self.i = (low_n, high_n), end + 1
        if bounds is None:
            return 1, 1
        if bounds[1] is None or char == "?":
            self.num_open_repeats += 1
        if self.i < len(text) and text[self.i] in "?+":  # lazy or possessive: the same repetition
            self.i += 1
        return bounds
