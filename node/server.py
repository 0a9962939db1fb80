"""NodeServer: an LLMEngine behind a ZMQ ROUTER control socket (the loop every node kind runs).

Proxies connect DEALER sockets and send engine.protocol messages; the server answers each
request on the socket identity it came from and sends every known proxy a LoadReport
periodically (the heartbeat). Role-specific KV handling (leases, pulls) lives in the node
packages, which subclass this and override the hooks; a plain NodeServer is a colocated node.

The heartbeat comes from a thread of its own, sending the load the loop last recorded: one
engine step can outlast the proxy's heartbeat timeout (measured: a 2,048-token prefill chunk of
the small preset takes ~6 s on one core), and a busy node is not a dead one. The loop and that
thread share the ROUTER socket under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from engine import protocol
from engine.engine import LLMEngine, StepOutput
from engine.protocol import ErrorReply, RequestDelta, Role, TokenBatch
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50
_BUSY_POLL_MS = 2


@dataclass(frozen=True)
class ServerConfig:
    node_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    load_report_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.load_report_interval_s <= 0:
            raise ValueError(f"load_report_interval_s must be > 0, got {self.load_report_interval_s}")


class NodeServer:
    """Runs until stop() (or SIGTERM via the node's main). Not thread-safe apart from stop()."""

    role = Role.COLOCATED

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self._context = zmq.Context.instance()
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if config.port:
            self.socket.bind(f"tcp://{config.host}:{config.port}")
            self.port = config.port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{config.host}")
        self._owners: dict[str, bytes] = {}  # request_id -> proxy socket identity
        self._last_request_seqs: dict[bytes, int] = {}  # every proxy heard from -> seq of its last request
        self._socket_lock = threading.Lock()
        self._load = _LoadSnapshot({}, {})  # replaced whole by the loop; read by the heartbeat
        self._is_stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._send_heartbeats, name="node-heartbeat", daemon=True)
        self.num_kv_fallbacks = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def stop(self) -> None:
        self._is_stopping.set()

    def run(self) -> None:
        logger.info("%s node %s serving on %s", self.role.value, self.config.node_id, self.address)
        self._record_load()
        self._heartbeat.start()
        try:
            while not self._is_stopping.is_set():
                self.run_once()
        finally:
            self.close()

    def run_once(self) -> None:
        busy = self.engine.has_unfinished() or self.has_pending_work()
        self._receive_all(timeout_ms=0 if self.engine.has_unfinished() else (_BUSY_POLL_MS if busy else _IDLE_POLL_MS))
        self.poll_transfers()
        self._record_load()
        if self.engine.has_unfinished():
            self._step()

    def close(self) -> None:
        self._is_stopping.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join()
        self.socket.close(linger=0)

    # ---- hooks for the node packages ----------------------------------------------------------

    def has_pending_work(self) -> bool:
        """True while transfers are in flight (the loop then polls them without idling)."""
        return False

    def poll_transfers(self) -> None:
        """Drive KV transfers and lease expiry; called every loop iteration."""

    def handle_decode_request(self, message: protocol.DecodeRequest) -> None:
        if message.kv_handle is not None:
            raise ValueError(f"request {message.request_id}: this node does not pull KV (role {self.role.value})")
        self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, message.first_token)

    def handle_prefill_request(self, message: protocol.PrefillRequest) -> None:
        raise ValueError(
            f"request {message.request_id}: this node does not take prefill requests (role {self.role.value})")

    def handle_abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def handle_release(self, request_id: str) -> None:
        """ReleaseKV from the proxy: only a prefill node holds leases."""

    def send_step_outputs(self, outputs: list[StepOutput]) -> None:
        by_owner: dict[bytes, list[RequestDelta]] = {}
        for out in outputs:
            owner = self._owner_of(out)
            if owner is not None:
                by_owner.setdefault(owner, []).append(_delta(out))
        for owner, deltas in by_owner.items():
            self.send(owner, TokenBatch(deltas))

    def load_extras(self) -> dict:
        return {}

    # ---- shared helpers -----------------------------------------------------------------------

    def add_local_request(
        self, request_id: str, prompt: list[int], sampling: protocol.SamplingOptions,
        first_token: protocol.TokenLogprob | None,
    ) -> None:
        params = SamplingParams.from_options(sampling)
        outputs = [first_token.token_id] if first_token else None
        self.engine.add_request(request_id, prompt, params, output_token_ids=outputs)

    def send(self, identity: bytes, message) -> None:
        """Queue a message for one proxy without blocking (dropped, logged, if it is not reading)."""
        try:
            with self._socket_lock:
                self.socket.send_multipart([identity, protocol.encode(message)], flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("dropped a %s to a proxy that is not reading", type(message).__name__)

    def forget(self, request_id: str) -> bytes | None:
        return self._owners.pop(request_id, None)

    def reply_error(self, request_id: str, exc: Exception, is_client_error: bool) -> None:
        owner = self._owners.pop(request_id, None)
        if owner is not None:
            self.send(owner, ErrorReply(request_id, type(exc).__name__, str(exc), is_client_error))

    # ---- the loop's parts ---------------------------------------------------------------------

    def _receive_all(self, timeout_ms: int) -> None:
        with self._socket_lock:  # NOTE: a ZMQ socket is not thread-safe, poll included
            if not self.socket.poll(timeout_ms):
                return
        while True:
            try:
                with self._socket_lock:
                    identity, payload = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                logger.warning("dropped a frame set of the wrong shape")
                continue
            self._last_request_seqs.setdefault(identity, 0)  # a proxy heard from gets reports
            self._dispatch(identity, payload)

    def _dispatch(self, identity: bytes, payload: bytes) -> None:
        try:
            message = protocol.decode_to_node(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("undecodable message from a proxy: %s", exc)
            return
        self.handle_message(identity, message)

    def handle_message(self, identity: bytes, message: protocol.ToNode) -> None:
        """Act on one decoded message from the proxy at identity (replies go back there)."""
        if isinstance(message, protocol.Ping):
            self._send_load_report(identity)
        elif isinstance(message, protocol.Abort):
            for request_id in message.request_ids:
                self._owners.pop(request_id, None)
                self.handle_abort(request_id)
        elif isinstance(message, protocol.ReleaseKV):
            for request_id in message.request_ids:
                self.handle_release(request_id)
        else:
            self._owners[message.request_id] = identity
            self._last_request_seqs[identity] = message.seq
            self._admit(message)

    def _admit(self, message) -> None:
        try:
            if isinstance(message, protocol.PrefillRequest):
                self.handle_prefill_request(message)
            else:
                self.handle_decode_request(message)
        except ValueError as exc:
            self.reply_error(message.request_id, exc, is_client_error=True)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - process edge: fail the batch, keep serving
            logger.exception("engine step failed; failing its requests")
            self._fail_all(exc)
            return
        self.send_step_outputs(outputs)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            self.reply_error(request_id, exc, is_client_error=False)

    def _owner_of(self, out: StepOutput) -> bytes | None:
        if out.is_finished:
            return self._owners.pop(out.request_id, None)
        return self._owners.get(out.request_id)

    def _record_load(self) -> None:
        """Snapshot the load for the heartbeat thread (the loop's state must not be read there)."""
        engine = self.engine
        scheduler = engine.scheduler
        fields = dict(
            node_id=self.config.node_id,
            role=self.role,
            protocol_version=protocol.PROTOCOL_VERSION,
            model_name=engine.config.model.name,
            max_model_len=engine.max_total_tokens,
            block_size=engine.block_size,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_queued_prompt_tokens=scheduler.num_queued_prompt_tokens,
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.block_pool.num_blocks,
            num_kv_fallbacks=self.num_kv_fallbacks,
            prefill_tokens_per_s=engine.prefill_rate.tokens_per_s,
            **self.load_extras(),
        )
        self._load = _LoadSnapshot(fields, dict(self._last_request_seqs))

    def _send_load_report(self, identity: bytes) -> None:
        self.send(identity, self._load.report_for(identity))

    def _send_heartbeats(self) -> None:
        while not self._is_stopping.wait(self.config.load_report_interval_s):
            load = self._load
            for identity in load.last_request_seqs:
                self.send(identity, load.report_for(identity))


@dataclass(frozen=True)
class _LoadSnapshot:
    """LoadReport fields as the loop last recorded them, and the proxies it has heard from with
    the seq of each one's last request (the report to a proxy echoes its own)."""

    fields: dict
    last_request_seqs: dict[bytes, int] = field(default_factory=dict)

    def report_for(self, identity: bytes) -> protocol.LoadReport:
        return protocol.LoadReport(**self.fields, sent_at=time.time(),
                                   last_request_seq=self.last_request_seqs.get(identity, 0))


def _delta(out: StepOutput) -> RequestDelta:
    reason = out.finish_reason.value if out.finish_reason is not None else None
    return RequestDelta(out.request_id, out.new_tokens, reason, out.num_prompt_tokens, out.prompt_logprobs)
