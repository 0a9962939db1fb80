"""The proxy's view of its nodes: one DEALER socket per node, per-request message queues, load
reports (the heartbeat), death detection and routing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from engine import protocol
from proxy.errors import NodeDied

logger = logging.getLogger(__name__)

# How often silent nodes are pinged and dead ones' requests failed. Cheap: a ping to a node
# that is not connected fails at once (IMMEDIATE), and one that answers stops being pinged.
_WATCH_INTERVAL_S = 0.1

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
    queues: dict[str, asyncio.Queue] = field(default_factory=dict)
    num_requests_sent: int = 0

    @property
    def is_healthy(self) -> bool:
        return self.last_report is not None and time.monotonic() - self.last_seen < self.heartbeat_timeout_s

    def send_request(self, message: protocol.PrefillRequest | protocol.DecodeRequest) -> None:
        """Send a request stamped with the next seq; routing counts it as load until a report
        acknowledges that seq. Raises NodeDied as send()."""
        seq = self.num_requests_sent + 1
        self.send(msgspec.structs.replace(message, seq=seq))
        self.num_requests_sent = seq
        num_tokens = len(message.prompt_token_ids)
        is_prefilled_here = isinstance(message, protocol.PrefillRequest) or message.kv_handle is None
        self.unreported.append(_Unreported(seq, num_tokens, num_tokens if is_prefilled_here else 0))

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

    def open(self, request_id: str) -> asyncio.Queue:
        """A queue receiving this node's messages for request_id (until close())."""
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def send(self, message) -> None:
        """Queue a message without blocking; raises NodeDied if the node is not connected (or
        not reading: the send buffer is full)."""
        # NOTE: zmq.asyncio reports a NOBLOCK send's zmq.Again through the returned (already
        # finished) future, not by raising.
        sent = self.socket.send(protocol.encode(message), flags=zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            raise NodeDied(f"{self.kind} node {self.address} is not accepting messages") from sent.exception()

    def fail_all(self, error: Exception) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)
        self.unreported.clear()  # failed with the node: never acknowledged, no longer load


class NodePool:
    """All nodes of both kinds; start() begins receiving, stop() closes every socket."""

    def __init__(self, prefill_addresses, decode_addresses, heartbeat_timeout_s: float,
                 local_prefill: LocalPrefillPolicy | None = None) -> None:
        self.context = zmq.asyncio.Context()
        self.prefill = [NodeClient(a, "prefill", heartbeat_timeout_s) for a in prefill_addresses]
        self.decode = [NodeClient(a, "decode", heartbeat_timeout_s) for a in decode_addresses]
        self.local_prefill = local_prefill
        self.num_local_prefills = 0
        self._tasks: list[asyncio.Task] = []

    @property
    def all(self) -> list[NodeClient]:
        return self.prefill + self.decode

    def start(self) -> None:
        for node in self.all:
            node.socket = self.context.socket(zmq.DEALER)
            node.socket.setsockopt(zmq.LINGER, 0)
            node.socket.setsockopt(zmq.SNDHWM, 100_000)
            # NOTE: queue nothing for a node that is not connected: a request to a dead node fails
            # at once, and a restarted node never receives requests its clients gave up on.
            node.socket.setsockopt(zmq.IMMEDIATE, 1)
            node.socket.connect(f"tcp://{node.address}")
            self._tasks.append(asyncio.create_task(self._receive(node)))
        self._tasks.append(asyncio.create_task(self._watch()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for node in self.all:
            if node.socket is not None:
                node.socket.close(linger=0)
        self.context.term()

    def max_model_len(self) -> int | None:
        lengths = [n.last_report.max_model_len for n in self.all if n.last_report]
        return min(lengths) if lengths else None

    def pick_prefill(self) -> NodeClient | None:
        """Least queued prompt tokens (as reported plus what this proxy has in flight)."""
        healthy = [n for n in self.prefill if n.is_healthy]
        if not healthy:
            return None
        return min(healthy, key=lambda n: n.last_report.num_queued_prompt_tokens + n.num_unreported_tokens)

    def pick_decode(self) -> NodeClient | None:
        """Most free blocks, then fewest running requests."""
        healthy = [n for n in self.decode if n.is_healthy]
        if not healthy:
            return None
        return max(healthy, key=_decode_score)

    def pick_local_prefill(self, prefill: NodeClient, num_prompt_tokens: int) -> NodeClient | None:
        """A decode node that should prefill this prompt itself rather than wait for the chosen
        prefill node (see LocalPrefillPolicy); None: use the prefill node."""
        policy = self.local_prefill
        remote_wait_s = prefill.prefill_wait_s(num_prompt_tokens)
        if policy is None or remote_wait_s is None or remote_wait_s < policy.min_wait_s:
            return None
        best, best_wait_s = None, remote_wait_s / policy.penalty
        for node in self.decode:
            wait_s = node.prefill_wait_s(num_prompt_tokens) if node.is_healthy else None
            if wait_s is not None and wait_s < best_wait_s:
                best, best_wait_s = node, wait_s
        if best is not None:
            self.num_local_prefills += 1
            logger.debug("prefilling %d tokens on decode node %s: %.1f s there vs %.1f s in the pool",
                         num_prompt_tokens, best.address, best_wait_s, remote_wait_s)
        return best

    def down(self) -> list[str]:
        return [f"{n.kind} {n.address}" for n in self.all if not n.is_healthy]

    async def _receive(self, node: NodeClient) -> None:
        _ping(node)
        while True:
            try:
                data = await node.socket.recv()
                message = protocol.decode_from_node(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("bad message from %s: %s", node.address, exc)
                continue
            if isinstance(message, protocol.LoadReport):
                _take_report(node, message)
            elif isinstance(message, protocol.TokenBatch):
                for delta in message.deltas:
                    _deliver(node, delta.request_id, delta)
            else:
                _deliver(node, message.request_id, message)

    async def _watch(self) -> None:
        """Ping silent nodes (they learn this proxy's identity) and fail requests on dead ones."""
        was_healthy = {id(n): False for n in self.all}
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            for node in self.all:
                healthy = node.is_healthy
                if not healthy:
                    _ping(node)
                    if was_healthy[id(node)] or node.queues:
                        logger.warning("%s node %s stopped reporting", node.kind, node.address)
                        node.fail_all(NodeDied(f"{node.kind} node {node.address} stopped responding"))
                was_healthy[id(node)] = healthy


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """Conditional disaggregation: prefill on a decode node when the prefill pool's estimated
    queue wait is at least min_wait_s and that node's own wait, times penalty, is shorter. The
    penalty stands for what the decode node's running requests lose while it prefills."""

    min_wait_s: float
    penalty: float


def _ping(node: NodeClient) -> None:
    """Ask for a LoadReport (a node answers only proxies it has heard from); no-op while the
    connection is down, the next tick tries again."""
    with contextlib.suppress(NodeDied):
        node.send(protocol.Ping())


def _decode_score(node: NodeClient) -> tuple[int, int]:
    """Free blocks left once the requests sent since the last report take theirs (in the node's
    own block size), then fewest requests."""
    report = node.last_report
    num_free_blocks = report.num_free_blocks - protocol.num_blocks_for(node.num_unreported_tokens, report.block_size)
    return num_free_blocks, -(report.num_running + report.num_waiting + len(node.unreported))


def _take_report(node: NodeClient, report: protocol.LoadReport) -> None:
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
    node.last_report = report
    node.last_seen = time.monotonic()
    # NOTE: by seq, not by time: a report made while a request was still in flight must keep
    # counting it (or a burst would all go to one node), whatever the two clocks say.
    node.unreported = [r for r in node.unreported if r.seq > report.last_request_seq]


def _deliver(node: NodeClient, request_id: str, message) -> None:
    queue = node.queues.get(request_id)
    if queue is not None:
        queue.put_nowait(message)
