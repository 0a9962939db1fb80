"""Node test fixtures and helpers: engines on the tiny model (make_engine, colocated_tokens), a
node server running on its own thread with a proxy's DEALER connected (serve_node), and a
prefill node and a decode node over the in-process fake transport, driven message by message
with no loop thread (Pair: build_pair, pair_factory, pair). What they make is closed when the
test ends, also when it fails (close_at_end)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import zmq

from decode_node.server import DecodeNode
from engine import protocol
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.protocol import Role
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from kv_transfer.fake import FakeConnector, FakeRegistry
from node.config import ServerConfig
from node.server import NodeServer
from node.transfer import connector_for, kv_layout
from prefill_node.server import PrefillNode
from tests.conftest import dealer

PROXY = b"proxy"
GREEDY = protocol.SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 2000 + 8 for i in range(37)]  # 3 blocks of 16, the last one partial
# The scheduler's own default, for engines whose tests leave max_num_seqs alone.
DEFAULT_MAX_NUM_SEQS = SchedulerConfig.max_num_seqs


def make_engine(model_dir, role: Role = Role.COLOCATED, num_blocks: int = 64, dtype: str = "float32",
                max_num_seqs: int = 8,
                max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens) -> LLMEngine:
    """An engine on model_dir's weights; 8 sequences at a time unless told (the pair tests')."""
    model = ModelConfig.from_pretrained(model_dir, dtype=dtype)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return LLMEngine(EngineConfig(model, CacheConfig(num_blocks=num_blocks), scheduler, role=role))


def colocated_tokens(model_dir, sampling: dict[str, protocol.SamplingOptions],
                     prompt: list[int] = PROMPT) -> dict[str, list[int]]:
    """Request id -> the tokens a colocated engine generates for prompt with its options, the
    requests run together; the engine then holds no block and no request."""
    engine = make_engine(model_dir, Role.COLOCATED)
    for request_id, options in sampling.items():
        engine.add_request(request_id, prompt, SamplingParams.from_options(options))
    tokens = {request_id: [] for request_id in sampling}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t.token_id for t in out.new_tokens]
    engine.check_leaks()
    return tokens


def colocated_greedy(model_dir, prompt: list[int] = PROMPT) -> list[int]:
    """The GREEDY continuation of prompt from a colocated engine."""
    return colocated_tokens(model_dir, {"ref": GREEDY}, prompt)["ref"]


def next_message(socket: zmq.Socket, kind: type, timeout_s: float = 10.0):
    """The next message of type kind a node sends on socket (others before it are dropped)."""
    deadline = time.monotonic() + timeout_s
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if socket.poll(left_ms):
            message = protocol.decode_from_node(socket.recv())
            if isinstance(message, kind):
                return message
    raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")


@pytest.fixture
def close_at_end():
    """close_at_end(thing) -> thing, whose close() runs when the test ends (also when it fails),
    in the order given."""
    things = []

    def add(thing):
        things.append(thing)
        return thing

    yield add
    for thing in things:
        thing.close()


# ---- a node server on its own thread --------------------------------------------------------


class ServedNode(NamedTuple):
    server: NodeServer
    thread: threading.Thread  # running server.run()
    socket: zmq.Socket | None  # a proxy's DEALER connected to the server (None: not asked for)

    @classmethod
    def start(cls, server: NodeServer, connect: bool = True) -> ServedNode:
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        return cls(server, thread, dealer(server.address) if connect else None)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.server.stop()
        self.thread.join(timeout=10)


@pytest.fixture
def serve_node(close_at_end):
    """serve_node(server, connect=True) -> ServedNode: server.run() on a daemon thread and, with
    connect, a DEALER connected to it as a proxy's; closed when the test ends (the socket, then
    the server stopped and its thread joined)."""
    return lambda server, connect=True: close_at_end(ServedNode.start(server, connect))


# ---- a prefill and a decode node over the fake transport, driven by hand ----------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Pair:
    """A prefill node and a decode node sharing an in-process network; every message they send
    to the proxy lands in `sent`."""

    prefill: PrefillNode
    decode: DecodeNode
    registry: FakeRegistry
    clock: Clock
    sent: list = field(default_factory=list)

    def run(self, until, max_rounds: int = 400) -> None:
        """Turn both nodes' loops until until() holds (a grammar under way is waited for: its
        compile runs on another thread)."""
        for _ in range(max_rounds):
            if until():
                return
            for node in (self.prefill, self.decode):
                node.grammar_gate.wait(timeout_s=60.0)
            self.prefill.run_once()
            self.decode.run_once()
        raise AssertionError(f"not done after {max_rounds} rounds; sent: {self.sent}")

    def results(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]

    def prefill_prompt(self, request_id: str, prompt: list[int] = PROMPT) -> protocol.PrefillResult:
        self.prefill.handle_message(PROXY, protocol.PrefillRequest(request_id, prompt, GREEDY))
        self.run(lambda: any(r.request_id == request_id for r in self.results(protocol.PrefillResult)))
        return next(r for r in self.results(protocol.PrefillResult) if r.request_id == request_id)

    def send_decode(self, request_id: str, result: protocol.PrefillResult, prompt: list[int] = PROMPT) -> None:
        self.decode.handle_message(PROXY, protocol.DecodeRequest(request_id, prompt, GREEDY, result.first_token,
                                                                 result.kv_handle))

    def pull(self, request_id: str, prompt: list[int] = PROMPT) -> protocol.PrefillResult:
        """prefill_prompt, then send_decode with its result (the decode node pulls its KV)."""
        result = self.prefill_prompt(request_id, prompt)
        self.send_decode(request_id, result, prompt)
        return result

    def deltas_of(self, request_id: str) -> list[protocol.RequestDelta]:
        return [d for batch in self.results(protocol.TokenBatch) for d in batch.deltas if d.request_id == request_id]

    def tokens_of(self, request_id: str) -> list[int] | None:
        """The request's tokens (the prefill node's first, then the decode node's) once it
        finished, None before."""
        deltas = self.deltas_of(request_id)
        if not deltas or deltas[-1].finish_reason is None:
            return None
        [first] = [r.first_token.token_id for r in self.results(protocol.PrefillResult) if r.request_id == request_id]
        return [first] + [t.token_id for d in deltas for t in d.tokens]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def build_pair(model_dir, *, decode_blocks: int = 64, decode_dtype: str = "float32", lease_timeout_s: float = 30.0,
               num_polls_per_read: int = 1, decode_max_seqs: int = 8, prefill_blocks: int = 64,
               metered: bool = False, prefill_chunk: int = SchedulerConfig.max_num_batched_tokens) -> Pair:
    """metered: the connectors built as a node process builds them (node.transfer.connector_for:
    metered, default timeouts, not on the pair's clock); num_polls_per_read applies without.
    prefill_chunk: the prefill engine's token budget per step (a longer prompt takes chunks)."""
    registry, clock = FakeRegistry(), Clock()
    prefill_engine = make_engine(model_dir, Role.PREFILL, prefill_blocks, max_num_batched_tokens=prefill_chunk)
    decode_engine = make_engine(model_dir, Role.DECODE, decode_blocks, decode_dtype, decode_max_seqs)
    if metered:
        holder = connector_for(prefill_engine, TransferConfig(backend="fake"), "prefill", registry)
        reader = connector_for(decode_engine, TransferConfig(backend="fake"), "decode", registry)
    else:
        holder = FakeConnector(TransferConfig(backend="fake"), prefill_engine.kv_cache, kv_layout(prefill_engine),
                               "prefill-engine", registry)
        reader = FakeConnector(TransferConfig(backend="fake", transfer_timeout_s=5.0), decode_engine.kv_cache,
                               kv_layout(decode_engine), "decode-engine", registry, clock, num_polls_per_read)
    pair = Pair(PrefillNode(prefill_engine, ServerConfig("prefill"), holder, lease_timeout_s),
                DecodeNode(decode_engine, ServerConfig("decode"), reader), registry, clock)
    for node in (pair.prefill, pair.decode):
        node.send = lambda _identity, message: pair.sent.append(message)
    return pair


@pytest.fixture
def pair_factory(tiny_model_dir, close_at_end):
    """build_pair(tiny_model_dir, **kwargs) for the test; every pair is closed when it ends."""
    return lambda **kwargs: close_at_end(build_pair(tiny_model_dir, **kwargs))


@pytest.fixture
def pair(pair_factory) -> Pair:
    """A pair as build_pair makes it by default."""
    return pair_factory()


def assert_nothing_held(pair: Pair) -> None:
    prefill, decode = pair.prefill, pair.decode
    assert len(prefill.leases) == 0, prefill.leases.request_ids()
    assert prefill.engine.num_free_blocks == prefill.engine.block_pool.num_blocks
    prefill.engine.check_leaks()
    assert not decode.has_pending_work() and decode.connector.num_reads_in_flight == 0
    decode.engine.check_leaks()


def release_notices_processed(pair: Pair):
    """No lease left, and the blocks of those its readers ended freed by the prefill node's loop."""
    engine = pair.prefill.engine
    return lambda: len(pair.prefill.leases) == 0 and engine.num_free_blocks == engine.block_pool.num_blocks


def assert_nothing_held_once_released(pair: Pair) -> None:
    """Turn both loops until release_notices_processed, then assert_nothing_held."""
    pair.run(release_notices_processed(pair))
    assert_nothing_held(pair)
