"""Grammars compile off the node's loop (node.grammar_gate): while one compiles, other requests
run and the loop makes progress; a compile past its budget is a 400 for its requests and for
every later one with the same schema while it runs on, without compiling again (its grammar
serves once it finishes); a request whose compile cannot
start in time is refused as QueueFull (the proxy retries elsewhere); one compile serves every
request asking for the same schema; a request aborted while it waits is answered nothing and
held nowhere; regexes, choices and EBNF grammars compile there too, and one the library cannot
parse or past the budget is a 400. The compile is held on an event (a stand-in for a costly
schema) so that each of these happens when the test says."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from engine import protocol
from engine import sampling_rules as rules
from engine.protocol import Role, SamplingOptions, StructuredKind, StructuredOutput
from node.config import ServerConfig
from node.server import NodeServer
from tests.nodes.conftest import GREEDY, PROMPT, PROXY, make_engine

MAX_WAIT_S = 60.0


def schema(name: str) -> StructuredOutput:
    return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({
        "type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}))


def structured(name: str) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, max_tokens=8, structured=schema(name))


class HeldCompiles:
    """Grammars.build made to wait for release() (then compile for real), counting its calls."""

    def __init__(self, node: NodeServer) -> None:
        self.released = threading.Event()
        self.builds: list[str] = []
        grammars = node.engine.grammars
        real_build = grammars.build

        def held_build(spec):
            self.builds.append(spec.json_schema)
            self.released.wait(MAX_WAIT_S)
            return real_build(spec)

        grammars.build = held_build

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def node_factory(tiny_model_dir):
    made = []

    def make(**config) -> tuple[NodeServer, list, HeldCompiles]:
        node = NodeServer(make_engine(tiny_model_dir, Role.COLOCATED), ServerConfig("gate", **config))
        sent = []
        node.send = lambda _identity, message: sent.append(message)
        held = HeldCompiles(node)
        made.append((node, held))
        return node, sent, held

    yield make
    for node, held in made:
        held.release()
        node.close()


def run_until(node: NodeServer, until) -> None:
    deadline = time.monotonic() + MAX_WAIT_S
    while not until():
        assert time.monotonic() < deadline, "not done in time"
        node.run_once()


def finished(sent: list, request_id: str) -> bool:
    return any(d.request_id == request_id and d.finish_reason for b in sent if isinstance(b, protocol.TokenBatch)
               for d in b.deltas)


def error_of(sent: list, request_id: str) -> protocol.ErrorReply | None:
    return next((e for e in sent if isinstance(e, protocol.ErrorReply) and e.request_id == request_id), None)


def test_other_requests_run_while_a_grammar_compiles_and_it_is_compiled_once(node_factory):
    node, sent, held = node_factory()
    node.handle_message(PROXY, protocol.DecodeRequest("json-1", PROMPT, structured("age")))
    node.handle_message(PROXY, protocol.DecodeRequest("json-2", PROMPT, structured("age")))
    node.handle_message(PROXY, protocol.DecodeRequest("greedy", PROMPT, GREEDY))
    progress = node.progress
    run_until(node, lambda: finished(sent, "greedy") and len(held.builds) == 1)
    assert node.progress > progress and len(node.grammar_gate) == 2 and node.num_waiting_requests == 2
    assert not finished(sent, "json-1") and len(held.builds) == 1  # one compile for both
    held.release()
    run_until(node, lambda: finished(sent, "json-1") and finished(sent, "json-2"))
    assert len(held.builds) == 1 and len(node.grammar_gate) == 0
    node.engine.check_leaks()


def test_a_compile_past_its_budget_is_a_client_error_for_every_request_until_it_finishes(node_factory):
    node, sent, held = node_factory(grammar_compile_timeout_s=0.2)
    node.handle_message(PROXY, protocol.DecodeRequest("costly", PROMPT, structured("age")))
    run_until(node, lambda: error_of(sent, "costly") is not None)
    error = error_of(sent, "costly")
    assert error.is_client_error and "took over 0.2 s to compile" in error.message
    assert node.grammar_gate.num_timeouts == 1 and node.grammar_gate.num_runaway == 1
    scraped = node.metrics.render().decode()
    assert re.search(r"^pdserve_node_grammar_timeouts_total\{.*\} 1\.0$", scraped, re.MULTILINE)
    assert re.search(r"^pdserve_node_grammar_runaway_compiles\{.*\} 1\.0$", scraped, re.MULTILINE)
    node.handle_message(PROXY, protocol.DecodeRequest("again", PROMPT, structured("age")))
    again = error_of(sent, "again")  # answered on arrival: the refusal is remembered
    assert again is not None and again.is_client_error and len(held.builds) == 1
    held.release()
    run_until(node, lambda: node.grammar_gate.num_runaway == 0)
    # Finished after all: its grammar is kept, and the schema served from then on.
    node.handle_message(PROXY, protocol.DecodeRequest("later", PROMPT, structured("age")))
    run_until(node, lambda: finished(sent, "later"))
    assert len(held.builds) == 1
    node.engine.check_leaks()


def test_a_compile_that_cannot_start_in_time_is_refused_as_queue_full(node_factory):
    node, sent, held = node_factory(grammar_threads=1, grammar_compile_timeout_s=0.2)
    node.handle_message(PROXY, protocol.DecodeRequest("first", PROMPT, structured("age")))
    node.handle_message(PROXY, protocol.DecodeRequest("queued", PROMPT, structured("name")))
    run_until(node, lambda: error_of(sent, "queued") is not None and error_of(sent, "first") is not None)
    queued = error_of(sent, "queued")
    assert queued.kind == protocol.QUEUE_FULL_ERROR_KIND and not queued.is_client_error
    assert queued.kind in protocol.RETRYABLE_ERROR_KINDS
    assert error_of(sent, "first").is_client_error  # the one compiling passed its budget
    held.release()
    # The queued schema was never refused: it compiles when asked again.
    node.handle_message(PROXY, protocol.DecodeRequest("retried", PROMPT, structured("name")))
    run_until(node, lambda: finished(sent, "retried"))
    node.engine.check_leaks()


def test_a_request_aborted_while_its_grammar_compiles_is_held_nowhere(node_factory):
    node, sent, held = node_factory()
    node.handle_message(PROXY, protocol.DecodeRequest("aborted", PROMPT, structured("age")))
    assert node.num_waiting_requests == 1
    node.handle_message(PROXY, protocol.Abort(["aborted"]))
    assert len(node.grammar_gate) == 0 and node.proxies.owner("aborted") is None
    held.release()
    node.grammar_gate.wait(MAX_WAIT_S)
    node.run_once()
    assert not any(getattr(m, "request_id", None) == "aborted" for m in sent)
    assert not any(d.request_id == "aborted" for b in sent if isinstance(b, protocol.TokenBatch) for d in b.deltas)
    assert node.engine.grammars.num_compiled == 1  # the compile still serves the next request
    node.engine.check_leaks()


def test_regex_choice_and_ebnf_compile_on_the_gate_and_one_that_cannot_is_a_client_error(node_factory,
                                                                                        tiny_model_dir):
    """vLLM's guided_regex, guided_choice and guided_grammar as the node enforces them; the node
    checks the budget again (a proxy may not have)."""
    from transformers import AutoTokenizer

    node, sent, held = node_factory()
    held.release()
    good = {"regex": StructuredOutput(StructuredKind.REGEX, regex=r"[a-z]{2,5}-\d{2}"),
            "choice": StructuredOutput(StructuredKind.CHOICE, choices=("red", "green", "blue")),
            "ebnf": StructuredOutput(StructuredKind.EBNF, grammar='root ::= "x=" [0-9] [0-9]? ";"')}
    bad = {"bad-regex": (StructuredOutput(StructuredKind.REGEX, regex="(("), "Regex parsing error"),
           "bad-ebnf": (StructuredOutput(StructuredKind.EBNF, grammar="root ::= y"), 'Rule "y" is not defined'),
           "costly": (StructuredOutput(StructuredKind.REGEX, regex="a*" * 40), "40 repetitions of open count"),
           "big": (StructuredOutput(StructuredKind.EBNF, grammar="root ::= " + '"a" ' * rules.MAX_GRAMMAR_BYTES),
                   f"the limit is {rules.MAX_GRAMMAR_BYTES}")}
    specs = {**good, **{request_id: spec for request_id, (spec, _) in bad.items()}}
    for request_id, spec in specs.items():
        options = SamplingOptions(temperature=0.0, max_tokens=32, structured=spec)
        node.handle_message(PROXY, protocol.DecodeRequest(request_id, PROMPT, options))
    run_until(node, lambda: all(finished(sent, r) or error_of(sent, r) for r in specs))
    assert len(held.builds) == len(specs)  # each compiled on a grammar thread, none on the loop
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = {request_id: tokenizer.decode([t.token_id for b in sent if isinstance(b, protocol.TokenBatch)
                                           for d in b.deltas if d.request_id == request_id for t in d.tokens][:-1])
             for request_id in good}
    assert re.fullmatch(r"[a-z]{2,5}-\d{2}", texts["regex"]) and texts["choice"] in ("red", "green", "blue"), texts
    assert re.fullmatch(r"x=\d\d?;", texts["ebnf"]), texts
    for request_id, (_, words) in bad.items():
        error = error_of(sent, request_id)
        assert error is not None and error.is_client_error and words in error.message, (request_id, error)
    node.engine.check_leaks()
