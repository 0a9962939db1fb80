"""The proxy's pool of nodes (each a proxy.node_client.NodeClient): connecting and receiving,
death detection, and routing (a prefill node only with decode nodes of the same KV layout)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from engine import protocol
from engine.protocol import default_of
from proxy.config import ProxyConfig
from proxy.errors import NodeDied
from proxy.node_client import STALL_TIMEOUT_S, NodeClient, deliver, log_version_mismatch, ping, take_report
from proxy.routing import PromptBlocks, Router, RoutingConfig, num_cached_tokens

logger = logging.getLogger(__name__)

# How often silent nodes are pinged and dead ones' requests failed. Cheap: a ping to a node
# that is not connected fails at once (IMMEDIATE).
_WATCH_INTERVAL_S = 0.1
# NOTE: every node is pinged at least this often even while it reports: a node ends the
# requests of a proxy it has not heard from within its orphan timeout (10 s by default).
_PING_INTERVAL_S = 0.5
# NOTE: the proxy's own loop away this much longer than the watch's interval (a GC pause, a
# starved process) is its own doing: the nodes' reports sat unread meanwhile, and are not held
# against them. Seen in a loaded test run: both fake nodes judged "stopped responding" at once.
_OWN_STALL_S = 0.5


@dataclass(frozen=True)
class RetryLimits:
    """How often one request may be re-sent (ProxyConfig.max_attempts, max_migrations): read by
    proxy.request_flow from the pool it runs on."""

    max_attempts: int = default_of(ProxyConfig, "max_attempts")
    max_migrations: int = default_of(ProxyConfig, "max_migrations")
    decode_wait_s: float = default_of(ProxyConfig, "decode_wait_s")


class NodePool:
    """All nodes of both kinds; start() begins receiving, stop() closes every socket."""

    def __init__(self, prefill_addresses, decode_addresses, heartbeat_timeout_s: float,
                 local_prefill: LocalPrefillPolicy | None = None,
                 curve_keys: protocol.CurveKeys | None = None, stall_timeout_s: float = STALL_TIMEOUT_S,
                 retry_limits: RetryLimits | None = None, routing: RoutingConfig | None = None,
                 kv_stream_min_tokens: int | None = None) -> None:
        self.context = zmq.asyncio.Context()
        self.kv_stream_min_tokens = kv_stream_min_tokens  # ProxyConfig's: read by proxy.request_flow
        self.prefill = [NodeClient(a, "prefill", heartbeat_timeout_s, stall_timeout_s=stall_timeout_s)
                        for a in prefill_addresses]
        self.decode = [NodeClient(a, "decode", heartbeat_timeout_s, stall_timeout_s=stall_timeout_s)
                       for a in decode_addresses]
        self.heartbeat_timeout_s, self.stall_timeout_s = heartbeat_timeout_s, stall_timeout_s  # for add_node
        self.local_prefill = local_prefill
        self.curve_keys = curve_keys
        self.retry_limits = retry_limits or RetryLimits()
        self.router = Router(routing)
        self.num_local_prefills = 0
        # NOTE: one routing id for all of this proxy's sockets, kept across reconnects: a node
        # hands a reconnected socket the same requests, and tells this proxy from others.
        self.identity = f"proxy-{uuid.uuid4().hex[:12]}".encode()
        self._mismatches_logged: set[tuple[str, str]] = set()
        self._tasks: list[asyncio.Task] = []
        self._receivers: dict[int, asyncio.Task] = {}  # id(node) -> its receiving task

    @property
    def all(self) -> list[NodeClient]:
        return self.prefill + self.decode

    def start(self) -> None:
        for node in self.all:
            self._connect(node)
        self._tasks.append(asyncio.create_task(self._watch()))

    def add_node(self, address: str, kind: str) -> NodeClient:
        """A node joining a started pool (proxy.discovery): connected and pinged at once, routed
        to as soon as it reports. Raises ValueError if the pool has it already."""
        if any(n.address == address and n.kind == kind for n in self.all):
            raise ValueError(f"{kind} node {address} is in the pool already")
        node = NodeClient(address, kind, self.heartbeat_timeout_s, stall_timeout_s=self.stall_timeout_s)
        (self.prefill if kind == "prefill" else self.decode).append(node)
        self._connect(node)
        return node

    def remove_node(self, node: NodeClient) -> None:
        """Forget a node (proxy.discovery, once it holds no request of this proxy): its socket
        closes, routing never sees it again."""
        (self.prefill if node.kind == "prefill" else self.decode).remove(node)
        task = self._receivers.pop(id(node), None)
        if task is not None:
            task.cancel()
        node.fail_all(NodeDied(f"{node.kind} node {node.address} was removed from the pool"))
        if node.socket is not None:
            node.socket.close(linger=0)

    def _connect(self, node: NodeClient) -> None:
        """Open node's DEALER socket and start receiving from it."""
        node.socket = self.context.socket(zmq.DEALER)
        node.socket.setsockopt(zmq.LINGER, 0)
        node.socket.setsockopt(zmq.SNDHWM, 100_000)
        # NOTE: queue nothing for a node that is not connected: a request to a dead node fails
        # at once, and a restarted node never receives requests its clients gave up on.
        node.socket.setsockopt(zmq.IMMEDIATE, 1)
        node.socket.setsockopt(zmq.IDENTITY, self.identity)
        if self.curve_keys is not None:
            keys = self.curve_keys
            node.socket.curve_serverkey = keys.server_public
            node.socket.curve_publickey = keys.client_public
            node.socket.curve_secretkey = keys.client_secret
        node.socket.connect(f"tcp://{node.address}")
        self._receivers[id(node)] = asyncio.create_task(self._receive(node))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._receivers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in self.all:
            if node.socket is not None:
                node.socket.close(linger=0)
        self.context.term()

    def drain(self, node_name: str, reason: str = "") -> NodeClient:
        """Ask one node to drain (protocol.Drain, as SIGTERM: it refuses new requests, finishes
        the running ones, keeps its leases until pulled or expired, then exits; under `pdserve
        up` its supervisor then starts it afresh). node_name: its HOST:PORT, or its position name
        as in /health ("prefill0", "decode1": kind and index in this pool). Routing passes over
        it from now on (until it reports again under a new boot id). Returns the node; raises
        KeyError for an unknown name, NodeDied if it is not accepting messages."""
        node = self.node_named(node_name)
        node.send(protocol.Drain(reason))
        node.is_drain_requested = True
        logger.info("%s node %s: drain sent (%s)", node.kind, node.address, reason or "no reason given")
        return node

    def node_named(self, node_name: str) -> NodeClient:
        """The node whose address or position name ("decode1") is node_name; raises KeyError."""
        for kind, nodes in (("prefill", self.prefill), ("decode", self.decode)):
            for idx, node in enumerate(nodes):
                if node_name in (node.address, f"{kind}{idx}"):
                    return node
        raise KeyError(f"no node named {node_name!r}")

    def max_model_len(self) -> int | None:
        lengths = [n.last_report.max_model_len for n in self.all if n.last_report]
        return min(lengths) if lengths else None

    def has_serving_path(self) -> bool:
        """Whether a new request can be served now: some decode node takes requests (with the
        prefill pool down, decode nodes prefill themselves). For the proxy's /ready."""
        return any(n.is_routable for n in self.decode)

    def pick_prefill(self, exclude: frozenset[int] = frozenset(), prompt: PromptBlocks | None = None
                     ) -> NodeClient | None:
        """The prefill node for this prompt by the routing policy (proxy.routing; without a
        prompt, the fewest queued prompt tokens), among the healthy prefill nodes that some
        healthy decode node can pull from (same KV layout). While no decode node is healthy at
        all, among every healthy prefill node: the request then waits for a decode node before it
        is prefilled (request_flow, ProxyConfig.decode_wait_s). Counts the choice (routing_decisions)."""
        healthy = [n for n in self.prefill if n.is_routable and id(n) not in exclude]
        if any(n.is_routable for n in self.decode):
            healthy = [n for n in healthy if self.decode_candidates(n)]
        if not healthy:
            return None
        return self.router.pick_prefill(self._not_full(healthy), self.prefill, prompt)

    def pick_decode(self, prefill: NodeClient | None = None, exclude: frozenset[int] = frozenset(),
                    prompt: PromptBlocks | None = None) -> NodeClient | None:
        """The decode node for this prompt by the routing policy (proxy.routing; without a prompt,
        the most free blocks, then the fewest requests); with prefill given, only among the
        decode nodes of its KV layout (that can read its blocks). exclude: id()s of nodes not to
        pick (ones that failed this request). Counts the choice (routing_decisions): to ask
        whether one exists, decode_candidates()."""
        candidates = self.decode_candidates(prefill, exclude)
        if not candidates:
            return None
        return self.router.pick_decode(self._not_full(candidates), self.decode, prompt)

    def decode_candidates(self, prefill: NodeClient | None = None,
                          exclude: frozenset[int] = frozenset()) -> list[NodeClient]:
        """The decode nodes pick_decode chooses among (before passing over full ones)."""
        healthy = [n for n in self.decode if n.is_routable and id(n) not in exclude]
        if prefill is not None:
            healthy = [n for n in healthy if n.kv_fingerprint == prefill.kv_fingerprint]
        return healthy

    def why_no_decode(self, prefill: NodeClient) -> str:
        """Why no decode node can take prefill's requests, naming the ones still starting (never
        reported) where that is why: nothing is prefilled for a request no decode node can take."""
        starting = [n.address for n in self.decode if n.last_report is None]
        if starting and not any(n.is_routable for n in self.decode):
            return (f"no decode node is ready yet: {', '.join(starting)} still starting; nothing was prefilled, "
                    "retry shortly")
        return f"no healthy decode node shares the KV layout of prefill node {prefill.address}; nothing was prefilled"

    def layout_mismatches(self) -> list[LayoutMismatch]:
        """Healthy prefill/decode pairs whose KV layouts differ (never paired), each logged once."""
        mismatches = []
        for prefill in (n for n in self.prefill if n.is_healthy and n.last_report.kv_layout is not None):
            for decode in (n for n in self.decode if n.is_healthy and n.last_report.kv_layout is not None):
                if prefill.kv_fingerprint != decode.kv_fingerprint:
                    mismatches.append(_mismatch(prefill, decode))
        for mismatch in mismatches:
            if (mismatch.prefill, mismatch.decode) not in self._mismatches_logged:
                self._mismatches_logged.add((mismatch.prefill, mismatch.decode))
                logger.error("%s: never routed together", mismatch.describe())
        return mismatches

    def no_kv_path(self) -> str | None:
        """Why no request can take the disaggregated path (prefill nodes exist and are healthy,
        but no decode node shares a KV layout with any of them); None when one can."""
        healthy = [n for n in self.prefill if n.is_healthy]
        if not healthy or any(self.decode_candidates(n) for n in healthy):
            return None
        mismatches = self.layout_mismatches()
        detail = "; ".join(m.describe() for m in mismatches) or "no healthy decode node"
        return f"no prefill/decode pair shares a KV layout: {detail}"

    def pick_local_prefill(self, prefill: NodeClient, prompt: PromptBlocks) -> NodeClient | None:
        """A decode node that should prefill this prompt itself rather than wait for the chosen
        prefill node (see LocalPrefillPolicy); None: use the prefill node. Each side's wait
        counts only the prompt tokens it does not cache (proxy.routing.num_cached_tokens): a
        mostly cached prompt is cheap to prefill where its cache is."""
        policy = self.local_prefill
        remote_wait_s = prefill.prefill_wait_s(len(prompt) - num_cached_tokens(prefill, prompt))
        if policy is None or remote_wait_s is None or remote_wait_s < policy.min_wait_s:
            return None
        best, best_wait_s = None, remote_wait_s / policy.penalty
        for node in self.decode:
            num_uncached = len(prompt) - num_cached_tokens(node, prompt)
            wait_s = node.prefill_wait_s(num_uncached) if node.is_routable else None
            if wait_s is not None and wait_s < best_wait_s:
                best, best_wait_s = node, wait_s
        if best is not None:
            self.num_local_prefills += 1
            best.routing_decisions["local_prefill"] += 1
            logger.debug("prefilling %d tokens on decode node %s: %.1f s there vs %.1f s in the pool",
                         len(prompt), best.address, best_wait_s, remote_wait_s)
        return best

    def down(self) -> list[str]:
        """Nodes not reporting, and pairs refused for differing KV layouts (with the fields)."""
        return ([f"{n.kind} {n.address}" for n in self.all if not n.is_healthy]
                + [m.describe() for m in self.layout_mismatches()])

    async def _receive(self, node: NodeClient) -> None:
        ping(node)
        while True:
            try:
                data = await node.socket.recv()
                message = protocol.decode_from_node(data)
            except msgspec.DecodeError as exc:
                version = protocol.frame_version(data)
                if version is not None and version != protocol.PROTOCOL_VERSION:
                    log_version_mismatch(node, version)
                else:
                    logger.warning("bad message from %s: %s", node.address, exc)
                continue
            if isinstance(message, protocol.LoadReport):
                take_report(node, message)
            elif isinstance(message, protocol.TokenBatch):
                for delta in message.deltas:
                    deliver(node, delta.request_id, delta)
            else:
                deliver(node, message.request_id, message)

    async def _watch(self) -> None:
        """Ping silent nodes (they learn this proxy's identity) at once and every node at least
        every _PING_INTERVAL_S (so none takes this proxy for gone), and fail requests on dead
        nodes."""
        was_healthy = {id(n): False for n in self.all}
        while True:
            due = time.monotonic() + _WATCH_INTERVAL_S
            await asyncio.sleep(_WATCH_INTERVAL_S)
            now = time.monotonic()
            if now - due >= _OWN_STALL_S:
                logger.warning("the proxy's loop was away %.1f s: not held against the nodes' heartbeats", now - due)
                for node in self.all:
                    node.forgive(now - due)
            for node in self.all:
                healthy = node.is_healthy
                if not node.is_routable or now - node.last_ping_at >= _PING_INTERVAL_S:
                    ping(node)
                if not healthy and (was_healthy.get(id(node), False) or node.queues):
                    why = "is stuck (no progress)" if node.is_stalled else "stopped responding"
                    logger.warning("%s node %s %s", node.kind, node.address, why)
                    node.fail_all(NodeDied(f"{node.kind} node {node.address} {why}"))
                was_healthy[id(node)] = healthy
            self.layout_mismatches()  # logs each new mismatched pair once, as soon as both report

    # Set by the proxy's admission (proxy.admission.is_full with its limits): routing passes over
    # full nodes. None: no node is ever full.
    is_full: Callable[[NodeClient], bool] | None = None

    def _not_full(self, nodes: list[NodeClient]) -> list[NodeClient]:
        """nodes less the full ones; all of them when every one is full (admission refuses new
        requests then, so only requests admitted just before the reports changed get here)."""
        if self.is_full is None:
            return nodes
        return [n for n in nodes if not self.is_full(n)] or nodes


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """Conditional disaggregation: prefill on a decode node when the prefill pool's estimated
    queue wait is at least min_wait_s and that node's own wait, times penalty, is shorter. The
    penalty stands for what the decode node's running requests lose while it prefills."""

    min_wait_s: float
    penalty: float


@dataclass(frozen=True)
class LayoutMismatch:
    """A prefill and a decode node that cannot exchange KV: the fields that differ, as
    (prefill's value, decode's value)."""

    prefill: str  # address
    decode: str
    fields: dict[str, tuple[str, str]]

    def describe(self) -> str:
        diffs = ", ".join(f"{name}: prefill {p!r}, decode {d!r}" for name, (p, d) in self.fields.items())
        return f"KV layout mismatch between prefill {self.prefill} and decode {self.decode} ({diffs})"


def _mismatch(prefill: NodeClient, decode: NodeClient) -> LayoutMismatch:
    ours, theirs = prefill.last_report.kv_layout.fields, decode.last_report.kv_layout.fields
    fields = {name: (ours.get(name, "?"), theirs.get(name, "?")) for name in sorted({*ours, *theirs})
              if ours.get(name) != theirs.get(name)}
    return LayoutMismatch(prefill.address, decode.address, fields)
