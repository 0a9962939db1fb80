"""The proxy's client of one node: its DEALER socket's sends, the load sent to it that its
reports do not show yet, and how its load reports and messages update this view (heartbeat,
stall, restart, protocol version)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from engine import protocol
from engine.protocol import default_of
from proxy.config import ProxyConfig
from proxy.errors import NodeDied
from proxy.routing import PrefixView, PromptBlocks, num_cached_tokens

logger = logging.getLogger(__name__)

# NOTE: a node that refused a send (not connected: IMMEDIATE) gets no new requests at once, and
# is taken for dead, its requests failed (retried or migrated), if it still refuses this much
# later: a killed node is known dead within about a second, not the heartbeat timeout.
_UNREACHABLE_GRACE_S = 0.5
STALL_TIMEOUT_S = default_of(ProxyConfig, "stall_timeout_s")  # see ProxyConfig


class _Expired:
    """A MessageQueue's timer went off while its reader waited (wait: which wait)."""

    __slots__ = ("wait",)

    def __init__(self, wait: int) -> None:
        self.wait = wait


class MessageQueue(asyncio.Queue):
    """A node's messages for one request, read with a bound on each wait (next_within).

    NOTE: one lazily moved timer per queue instead of asyncio.timeout around each read: arming and
    cancelling a timer per streamed token was a fifth of the proxy's CPU (benchmarks/proxy_capacity.py).
    The timer stays armed across reads; when it goes off early (the reader waits on a later
    deadline) it moves to that deadline, and where nobody waits it lapses."""

    def __init__(self) -> None:
        super().__init__()
        self._wait = 0  # the current (or last) next_within call
        self._deadline: float | None = None  # loop time the waiting reader gives up at; None: none waits
        self._timer: asyncio.TimerHandle | None = None

    async def next_within(self, timeout_s: float):
        """The next message; TimeoutError where none comes within timeout_s of waiting."""
        self._wait += 1
        wait = self._wait
        deadline = None
        while True:
            if self.empty():
                loop = asyncio.get_running_loop()
                if deadline is None:
                    deadline = loop.time() + timeout_s
                self._deadline = deadline
                if self._timer is None or self._timer.when() > deadline:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._timer = loop.call_at(deadline, self._go_off)
                try:
                    message = await self.get()
                finally:
                    self._deadline = None
            else:
                message = self.get_nowait()
            if type(message) is not _Expired:
                return message
            if message.wait == wait:
                raise TimeoutError
            # a stale one: the timer went off as a message came for an earlier wait

    def ready(self):
        """A message already here (None: none), without waiting."""
        while not self.empty():
            message = self.get_nowait()
            if type(message) is not _Expired:
                return message
        return None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _go_off(self) -> None:
        self._timer = None
        if self._deadline is None:
            return  # nobody waits: the next wait arms it again
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._go_off)
        else:
            self.put_nowait(_Expired(self._wait))


@dataclass(frozen=True)
class _Unreported:
    seq: int
    num_prompt_tokens: int
    num_prefill_tokens: int  # the prompt when the node prefills it; 0 for a KV pull


@dataclass
class NodeClient:
    address: str
    kind: str  # "prefill" | "decode"
    heartbeat_timeout_s: float
    socket: zmq.asyncio.Socket | None = None
    last_report: protocol.LoadReport | None = None
    last_seen: float = 0.0
    # Requests sent but not yet counted in a report of the node.
    unreported: list[_Unreported] = field(default_factory=list)
    queues: dict[str, MessageQueue] = field(default_factory=dict)
    num_requests_sent: int = 0
    last_ping_at: float = 0.0
    logged_version: int | None = None  # a foreign protocol version this node was logged speaking
    boot_id: str | None = None  # the node process's, from its reports: a new one is a restarted node
    progress_changed_at: float = 0.0  # when the reported loop progress last advanced
    unreachable_since: float | None = None  # the first failed send since the last report or good send
    stall_timeout_s: float = STALL_TIMEOUT_S
    # A Drain this proxy sent and the node's reports do not show yet: routed around meanwhile.
    is_drain_requested: bool = False
    prefix: PrefixView = field(default_factory=PrefixView)  # what it caches, as this proxy knows (proxy.routing)
    routing_decisions: Counter[str] = field(default_factory=Counter)  # requests routed here, by reason
    # Being taken out of this proxy's pool (proxy.discovery): no new requests; removed once the
    # requests it holds have ended. The node itself goes on serving (other proxies, say).
    is_retiring: bool = False

    @property
    def kv_fingerprint(self) -> str | None:
        """The KV layout fingerprint the node reports (None: unknown, or a node moving no KV)."""
        layout = self.last_report.kv_layout if self.last_report is not None else None
        return layout.fingerprint if layout is not None else None

    @property
    def is_healthy(self) -> bool:
        """Reporting within the heartbeat timeout, accepting messages (or refusing them for
        less than _UNREACHABLE_GRACE_S), and its loop not stuck. An unhealthy node's requests
        are failed (NodePool._watch)."""
        now = time.monotonic()
        if self.last_report is None or now - self.last_seen >= self.heartbeat_timeout_s:
            return False
        if self.unreachable_since is not None and now - self.unreachable_since >= _UNREACHABLE_GRACE_S:
            return False
        return not self.is_stalled

    @property
    def is_stalled(self) -> bool:
        """Its loop has not advanced for stall_timeout_s while it had requests."""
        report = self.last_report
        has_work = report is not None and (report.num_running + report.num_waiting > 0 or bool(self.queues))
        return has_work and time.monotonic() - self.progress_changed_at >= self.stall_timeout_s

    @property
    def is_draining(self) -> bool:
        return self.is_drain_requested or (self.last_report is not None and self.last_report.is_draining)

    @property
    def is_routable(self) -> bool:
        """Healthy, not draining and took the last message sent to it: new requests may go here."""
        return self.is_healthy and self.unreachable_since is None and not self.is_draining and not self.is_retiring

    def send_request(self, message: protocol.PrefillRequest | protocol.DecodeRequest,
                     prompt: PromptBlocks | None = None) -> None:
        """Send a request stamped with the next seq; routing counts it as load until a report
        acknowledges that seq (the tokens it prefills: the prompt less what this node caches of
        it). With the prompt's blocks given, they count as cached here from now on (see
        proxy.routing.PrefixView). Raises NodeDied as send()."""
        seq = self.num_requests_sent + 1
        self.send(msgspec.structs.replace(message, seq=seq))
        self.num_requests_sent = seq
        num_tokens = len(message.prompt_token_ids)
        is_prefilled_here = isinstance(message, protocol.PrefillRequest) or message.kv_handle is None
        num_prefill_tokens = num_tokens - num_cached_tokens(self, prompt) if is_prefilled_here else 0
        self.unreported.append(_Unreported(seq, num_tokens, num_prefill_tokens))
        if prompt is not None and self.last_report is not None:
            self.prefix.add(prompt.hashes(self.last_report.block_size))

    @property
    def num_unreported_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.unreported)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens this node has yet to prefill: reported plus sent since."""
        return self.last_report.num_queued_prompt_tokens + sum(r.num_prefill_tokens for r in self.unreported)

    def prefill_wait_s(self, num_prompt_tokens: int) -> float | None:
        """Estimated seconds until a prompt sent now is prefilled here; None while the node has
        not measured its prefill rate."""
        rate = self.last_report.prefill_tokens_per_s
        if rate <= 0:
            return None
        return (self.num_queued_prefill_tokens + num_prompt_tokens) / rate

    def open(self, request_id: str) -> MessageQueue:
        """A queue receiving this node's messages for request_id (until close())."""
        queue = MessageQueue()
        self.queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.close()

    def send(self, message) -> None:
        """Queue a message without blocking; raises NodeDied if the node is not connected (or
        not reading: the send buffer is full)."""
        # NOTE: zmq.asyncio reports a NOBLOCK send's zmq.Again through the returned (already
        # finished) future, not by raising.
        sent = self.socket.send(protocol.encode(message), flags=zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            if self.unreachable_since is None and self.last_report is not None:
                logger.warning("%s node %s refused a message: routing around it", self.kind, self.address)
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()
            raise NodeDied(f"{self.kind} node {self.address} is not accepting messages") from sent.exception()
        self.unreachable_since = None

    def forgive(self, away_s: float) -> None:
        """The proxy could not read this node's messages for away_s (its own stall): the
        heartbeat, stall and unreachable clocks move on by as much."""
        self.last_seen += away_s
        self.progress_changed_at += away_s
        if self.unreachable_since is not None:
            self.unreachable_since += away_s

    def fail_all(self, error: Exception) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)
        self.unreported.clear()  # failed with the node: never acknowledged, no longer load


def ping(node: NodeClient) -> None:
    """Ask for a LoadReport (a node answers only proxies it has heard from); no-op while the
    connection is down, the next tick tries again."""
    node.last_ping_at = time.monotonic()
    with contextlib.suppress(NodeDied):
        node.send(protocol.Ping())


def log_version_mismatch(node: NodeClient, version: int) -> None:
    """Logged once per node and version: the node stays unhealthy and gets no requests."""
    if node.logged_version != version:
        logger.error("%s node %s speaks protocol %d, this proxy %d: not using it", node.kind, node.address,
                     version, protocol.PROTOCOL_VERSION)
        node.logged_version = version


def take_report(node: NodeClient, report: protocol.LoadReport) -> None:
    """A report refreshes the heartbeat, unless the node speaks another protocol version (it
    then stays unhealthy and gets no requests). A report without a block size is malformed."""
    if report.block_size < 1:
        logger.warning("bad report from %s: block_size %d", node.address, report.block_size)
        return
    if report.protocol_version != protocol.PROTOCOL_VERSION:
        if node.last_report is None or node.last_report.protocol_version != report.protocol_version:
            logger.error("%s node %s speaks protocol %d, this proxy %d: not using it", node.kind, node.address,
                         report.protocol_version, protocol.PROTOCOL_VERSION)
        node.last_report = report
        return
    now = time.monotonic()
    if node.boot_id is not None and report.boot_id != node.boot_id:
        logger.warning("%s node %s restarted (new boot id): failing its %d requests", node.kind, node.address,
                       len(node.queues))
        node.fail_all(NodeDied(f"{node.kind} node {node.address} restarted"))
        node.is_drain_requested = False  # a new process: the drain was the old one's
    if node.last_report is None or report.progress != node.last_report.progress or report.boot_id != node.boot_id:
        node.progress_changed_at = now
    node.boot_id = report.boot_id
    node.last_report = report
    node.prefix.take(report)  # the newest digest; forgets the old process's on a new boot id
    node.last_seen = now
    node.unreachable_since = None
    # NOTE: by seq, not by time: a report made while a request was still in flight must keep
    # counting it (or a burst would all go to one node), whatever the two clocks say.
    node.unreported = [r for r in node.unreported if r.seq > report.last_request_seq]


def deliver(node: NodeClient, request_id: str, message) -> None:
    queue = node.queues.get(request_id)
    if queue is not None:
        queue.put_nowait(message)
