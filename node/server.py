"""NodeServer: an LLMEngine behind a ZMQ ROUTER control socket (the loop every node kind runs).

Proxies connect DEALER sockets and send engine.protocol messages; the server answers each
request on the socket identity it came from and sends every proxy it has heard from a
LoadReport periodically (the heartbeat). Role-specific KV handling (leases, pulls) lives in the
node packages, which subclass this and override the hooks; a plain NodeServer is a colocated node.

The heartbeat comes from a thread of its own, sending the load the loop last recorded: one
engine step can outlast the proxy's heartbeat timeout (measured: a 2,048-token prefill chunk of
the small preset takes ~6 s on one core), and a busy node is not a dead one. The loop and that
thread share the control socket (node.control), which locks.

Failure isolation: a message that is malformed, of another version, a duplicate request id or
a request that fails admission is refused (logged, rate-limited, counted) and changes nothing
else; an engine step that raises fails only its requests at fault (LLMEngine.step). A frame for
a proxy is never dropped: a send waits up to send_timeout_s for a slow proxy, and a proxy that
stays unreachable, or is silent (no message, no ping) for orphan_timeout_s, has its requests
ended here: aborted, their blocks and leases freed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import msgspec

from engine import protocol
from engine.engine import LLMEngine, StepOutput
from engine.errors import EngineBroken
from engine.protocol import ErrorReply, KVOutcome, KVSource, RequestDelta, Role, TokenBatch
from engine.sampling_params import SamplingParams
from node.config import ServerConfig
from node.control import ControlSocket
from node.core_lending import Borrower, Lender
from node.grammar_gate import GrammarGate
from node.health import HealthServer
from node.load_report import LoadSnapshot, record_load
from node.metrics import NodeMetrics
from node.prefix_cache import PrefixDigests
from node.proxies import ProxyTable, short_id

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50
_BUSY_POLL_MS = 2
# NOTE: frames taken per loop iteration before the engine steps again: a flood of messages
# cannot starve the running requests.
_MAX_FRAMES_PER_ITERATION = 256
_ORPHAN_CHECK_INTERVAL_S = 0.5
# The loop away longer than this is its own doing, not its proxies' silence (ProxyTable.forgive).
_OWN_STALL_S = 1.0
_LOCAL = KVOutcome(KVSource.LOCAL)


class NodeServer:
    """Runs until stop() (or SIGTERM via the node's main). Not thread-safe apart from stop()."""

    role = Role.COLOCATED

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.control = ControlSocket(config.host, config.port, config.curve_keys)
        self.port = self.control.port
        self.proxies = ProxyTable()
        self._unreachable: set[bytes] = set()  # proxies a send gave up on; ended by the loop
        self._kv_outcomes: dict[str, KVOutcome] = {}  # sent with each request's first delta
        self.prefix_digests = PrefixDigests(engine)  # the prefix-cache digest in LoadReports
        # Structured requests wait here while their grammar compiles on a worker thread.
        self.grammar_gate = GrammarGate(engine.grammars, config.grammar_threads, config.grammar_compile_timeout_s)
        self._load = LoadSnapshot({}, {})  # replaced whole by the loop; read by the heartbeat
        self._is_stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._send_heartbeats, name="node-heartbeat", daemon=True)
        self._next_orphan_check_at = 0.0
        self.num_kv_fallbacks_by_reason: dict[str, int] = {}
        self.num_orphaned_requests = 0
        self.boot_id = uuid.uuid4().hex  # NOTE: a restarted process is a new node to the proxy
        self.progress = 0  # loop iterations: the proxy and /health tell a stuck loop by it
        self.last_progress_at = time.monotonic()
        self.is_serving = False  # set once the loop runs (after warm-up): /ready
        self.failure: Exception | None = None  # what stopped the node, if it did not stop cleanly
        self._is_draining = threading.Event()
        self._drain_deadline: float | None = None  # set by the loop once it sees the drain
        self.metrics = NodeMetrics(engine.config.model.name, config.node_id, self.role.value, engine.max_total_tokens,
                                   lambda: self._load.fields, lambda: engine.scheduler.num_preemptions,
                                   lambda: getattr(self, "connector", None), lambda: self.grammar_gate)
        self._health = (HealthServer(config.host, config.health_port, self, self.metrics.render)
                        if config.health_port else None)
        # Core lending on one host (node.core_lending), set by the node's process when asked for.
        self.lender: Lender | None = None
        self.borrower: Borrower | None = None

    @property
    def is_draining(self) -> bool:
        return self._is_draining.is_set()

    def drain(self) -> None:
        """Stop taking new requests, finish the running ones (and, on a prefill node, wait until
        its leases are pulled or expire), then leave run(). Safe from a signal handler. SIGTERM
        and the proxy's Drain message both come here."""
        self._is_draining.set()

    @property
    def num_waiting_requests(self) -> int:
        """Requests here that do not run yet: in the scheduler's queue, waiting for a KV pull or
        for their grammar."""
        return (len(self.engine.scheduler.waiting) + self.load_extras().get("num_pending_pulls", 0)
                + len(self.grammar_gate))

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def num_kv_fallbacks(self) -> int:
        return sum(self.num_kv_fallbacks_by_reason.values())

    def stop(self) -> None:
        self._is_stopping.set()

    def run(self) -> None:
        trust = ("cluster secret set: CURVE, only its holders connect" if self.control.is_secured
                 else "no cluster secret: listening on loopback only")
        logger.info("%s node %s serving on %s (%s)", self.role.value, self.config.node_id, self.address, trust)
        self._record_load()
        self._heartbeat.start()
        if self._health is not None:
            self._health.start()
        self.is_serving = True
        try:
            while not self._is_stopping.is_set() and not self._is_drained():
                self.run_once()
        finally:
            self.close()

    def _is_drained(self) -> bool:
        if not self.is_draining:
            return False
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.config.drain_timeout_s
            logger.info("%s node %s draining: no new requests", self.role.value, self.config.node_id)
        if self.engine.has_unfinished() or self._has_work_beside_engine():
            if now < self._drain_deadline:
                return False
            logger.warning("%s node %s: drain timed out after %.0f s with work left: exiting", self.role.value,
                           self.config.node_id, self.config.drain_timeout_s)
            return True
        logger.info("%s node %s drained: exiting", self.role.value, self.config.node_id)
        return True

    def run_once(self) -> None:
        self.progress += 1
        now = time.monotonic()
        away = now - self.last_progress_at if self.last_progress_at else 0.0
        if away > _OWN_STALL_S:
            # NOTE: the loop's own absence (a long step, a stall) is not the proxies' silence:
            # before this, a node back from a 40 s stall aborted its proxy's requests as orphans.
            self.proxies.forgive(away)
        self.last_progress_at = now
        busy = self.engine.has_unfinished() or self.needs_polling() or len(self.grammar_gate) > 0
        self._receive_all(timeout_ms=0 if self.engine.has_unfinished() or self.is_copying()
                          else (_BUSY_POLL_MS if busy else _IDLE_POLL_MS))
        self._admit_compiled()
        self.poll_transfers()
        self.metrics.poll_leases(self.has_request)
        self._end_orphans()
        self._record_load()
        if self.lender is not None:
            self.lender.tell(self.engine.has_unfinished())
        if self.borrower is not None:
            self.borrower.update(prefilling=self.engine.scheduler.has_prompt_work,
                                 has_work=self.engine.has_unfinished())
            self.metrics.lent_cores_free.set(self.borrower.cores_free)
        if self.engine.has_unfinished():
            if self.borrower is None:
                self._step()
                return
            if self.borrower.is_borrowing:
                self.metrics.borrowed_steps.inc()
            preempted = self.borrower.num_preempted_steps
            with self.borrower.step():
                self._step()
            if self.borrower.num_preempted_steps != preempted:
                self.metrics.preempted_borrowed_steps.inc(self.borrower.num_preempted_steps - preempted)

    def close(self) -> None:
        self._is_stopping.set()
        self.grammar_gate.close()
        if self._heartbeat.is_alive():
            self._heartbeat.join()
        if self._health is not None:
            self._health.close()
        self.control.close()
        for share in (self.lender, self.borrower):
            if share is not None:
                share.close()

    # ---- hooks for the node packages ----------------------------------------------------------

    def has_pending_work(self) -> bool:
        """True while transfers are in flight (the loop then polls them without idling)."""
        return False

    def needs_polling(self) -> bool:
        """True while work beside the engine moves on without a message to wake the loop
        (transfers in flight): the loop then looks every _BUSY_POLL_MS."""
        return self.has_pending_work()

    def wake_sockets(self) -> list:
        """Sockets beside the control socket whose message ends the loop's wait (a KV read's
        confirmation coming back)."""
        return []

    def is_copying(self) -> bool:
        """Whether work beside the engine ends within microseconds with nothing to announce it (a
        device copy of KV): the loop then looks again at once."""
        return False

    def has_request(self, request_id: str) -> bool:
        """Whether request_id is in use here beyond the requests proxies own (a prefill lease)."""
        return False

    def poll_transfers(self) -> None:
        """Drive KV transfers and lease expiry; called every loop iteration."""

    def handle_decode_request(self, message: protocol.DecodeRequest) -> None:
        if message.kv_handle is not None:
            raise ValueError(f"request {message.request_id}: this node does not pull KV (role {self.role.value})")
        self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, message.first_token,
                               output_token_ids=message.output_token_ids)

    def handle_prefill_request(self, message: protocol.PrefillRequest) -> None:
        raise ValueError(
            f"request {message.request_id}: this node does not take prefill requests (role {self.role.value})")

    def handle_kv_progress(self, message: protocol.KVProgress) -> None:
        """A streamed prompt's KV so far, for the decode node pulling it; raises ValueError."""
        raise ValueError(f"request {message.request_id}: this node does not pull KV (role {self.role.value})")

    def fail_kv_progress(self, message: protocol.KVProgress, exc: ValueError) -> None:
        """handle_kv_progress refused message: the request, if here, ends with exc."""
        self.control.rejects.reject("unexpected", str(exc))

    def handle_abort(self, request_id: str, identity: bytes) -> None:
        """End request_id for the proxy at identity (no-op for an unknown request)."""
        self.engine.abort(request_id)

    def handle_release(self, request_id: str, identity: bytes) -> None:
        """ReleaseKV from the proxy at identity: only a prefill node holds leases."""

    def release_owned(self, identity: bytes) -> int:
        """End what this node holds for a vanished proxy beyond its requests (a prefill node's
        leases); returns how many."""
        return 0

    def send_step_outputs(self, outputs: list[StepOutput]) -> None:
        by_owner: dict[bytes, list[RequestDelta]] = {}
        for out in outputs:
            if out.error is not None:
                self.reply_failure(out.request_id, "StepFailed", out.error, is_client_error=False)
                continue
            owner = self._owner_of(out)
            if owner is not None:
                by_owner.setdefault(owner, []).append(self.delta(out))
        for owner, deltas in by_owner.items():
            self.send(owner, TokenBatch(deltas))

    def load_extras(self) -> dict:
        return {}

    def num_promised_blocks(self) -> int:
        """LoadReport.num_promised_blocks: what the engine's accepted requests still need."""
        return self.engine.scheduler.num_promised_blocks

    def kv_layout_info(self) -> protocol.KVLayoutInfo | None:
        """What a KV peer must share with this node (None: it moves no KV)."""
        return None

    @property
    def num_rejected_messages(self) -> int:
        return self.control.rejects.num_rejected

    # ---- shared helpers -----------------------------------------------------------------------

    def add_local_request(
        self, request_id: str, prompt: list[int], sampling: protocol.SamplingOptions,
        first_token: protocol.TokenLogprob | None, kv: KVOutcome = _LOCAL, output_token_ids: list[int] = (),
    ) -> None:
        params = SamplingParams.from_options(sampling)
        outputs = [first_token.token_id] if first_token else (list(output_token_ids) or None)
        self.engine.add_request(request_id, prompt, params, output_token_ids=outputs)
        self._kv_outcomes[request_id] = kv

    def note_kv_outcome(self, request_id: str, kv: KVOutcome) -> None:
        """Say how request_id got its KV, on its first delta."""
        self._kv_outcomes[request_id] = kv

    def delta(self, out: StepOutput) -> RequestDelta:
        reason = out.finish_reason.value if out.finish_reason is not None else None
        return RequestDelta(out.request_id, out.new_tokens, out.first_token_idx, reason, out.num_prompt_tokens,
                            out.prompt_logprobs, self._kv_outcomes.pop(out.request_id, None))

    def send(self, identity: bytes, message) -> None:
        """Send a message to one proxy, waiting up to send_timeout_s for room. A proxy that does
        not take it is marked unreachable: the loop ends its requests (never a silent drop)."""
        if identity in self._unreachable:
            return  # its requests are being ended; nothing more goes to it
        if not self.control.send(identity, protocol.encode(message), self.config.send_timeout_s):
            logger.error("proxy %s did not take a %s within %.1f s (gone or stuck): ending its requests",
                         short_id(identity), type(message).__name__, self.config.send_timeout_s)
            self._unreachable.add(identity)

    def forget(self, request_id: str) -> bytes | None:
        self.grammar_gate.discard(request_id)
        self._kv_outcomes.pop(request_id, None)
        self.metrics.forget(request_id)
        return self.proxies.forget(request_id)

    def reply_error(self, request_id: str, exc: Exception, is_client_error: bool) -> None:
        self.reply_failure(request_id, type(exc).__name__, str(exc), is_client_error)

    def reply_failure(self, request_id: str, kind: str, message: str, is_client_error: bool) -> None:
        """Tell the request's proxy it failed (the caller has freed what the request held)."""
        self.metrics.request_ended(request_id, "error")
        owner = self.forget(request_id)
        if owner is not None:
            self.send(owner, ErrorReply(request_id, kind, message, is_client_error))

    # ---- the loop's parts ---------------------------------------------------------------------

    def _receive_all(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms, self.wake_sockets() if timeout_ms else ()):
            return
        for identity, payload in self.control.receive(_MAX_FRAMES_PER_ITERATION):
            self._dispatch(identity, payload)

    def _dispatch(self, identity: bytes, payload: bytes) -> None:
        try:
            message = protocol.decode_to_node(payload)
        except msgspec.DecodeError as exc:
            self.control.rejects.reject("malformed", f"from {short_id(identity)}: {exc}")
            return
        self.proxies.heard(identity)
        self._unreachable.discard(identity)  # it speaks again: it is reachable
        self.handle_message(identity, message)

    def handle_message(self, identity: bytes, message: protocol.ToNode) -> None:
        """Act on one decoded message from the proxy at identity (replies go back there)."""
        if isinstance(message, protocol.Ping):
            self._send_load_report(identity)
        elif isinstance(message, protocol.Abort):
            for request_id in message.request_ids:
                self._abort(request_id, identity)
        elif isinstance(message, protocol.ReleaseKV):
            for request_id in message.request_ids:
                self.handle_release(request_id, identity)
        elif isinstance(message, protocol.KVProgress):
            self._take_kv_progress(message, identity)
        elif isinstance(message, protocol.Drain):
            if not self.is_draining:
                logger.info("%s node %s: drain asked by proxy %s (%s)", self.role.value, self.config.node_id,
                            short_id(identity), message.reason or "no reason given")
            self.drain()
            self._record_load()
            self._send_load_report(identity)  # NOTE: the proxy sees is_draining at once
        elif self.proxies.owner(message.request_id) is not None or self.has_request(message.request_id):
            self.proxies.last_request_seqs[identity] = message.seq  # received (and refused): acknowledged
            self.control.rejects.reject("duplicate_request_id", f"request {message.request_id} from "
                                                                f"{short_id(identity)}")
            self.send(identity, ErrorReply(message.request_id, "DuplicateRequestId", f"request id "
                                           f"{message.request_id!r} is already in use on node {self.config.node_id}",
                                           is_client_error=True))
        elif self.is_draining:
            self.proxies.last_request_seqs[identity] = message.seq  # received (and refused): acknowledged
            self.send(identity, ErrorReply(message.request_id, protocol.DRAINING_ERROR_KIND,
                                           f"node {self.config.node_id} is draining: request {message.request_id} "
                                           f"refused", is_client_error=False))
        elif self.num_waiting_requests >= self.config.max_num_waiting:
            self.proxies.last_request_seqs[identity] = message.seq  # received (and refused): acknowledged
            self.send(identity, ErrorReply(message.request_id, protocol.QUEUE_FULL_ERROR_KIND,
                                           f"node {self.config.node_id} has {self.num_waiting_requests} requests "
                                           f"waiting (its limit): request {message.request_id} refused",
                                           is_client_error=False))
        else:
            self.proxies.own(message.request_id, identity, message.seq)
            self.metrics.request_arrived(message.request_id)
            if not self.grammar_gate.park_if_compiling(message):
                self._admit(message)

    def _abort(self, request_id: str, identity: bytes) -> None:
        owner = self.proxies.owner(request_id)
        if owner is not None and owner != identity:
            self.control.rejects.reject("foreign_abort", f"{short_id(identity)} aborting {request_id} of "
                                                         f"{short_id(owner)}")
            return
        self.metrics.request_ended(request_id, "abort")
        self.forget(request_id)
        self.handle_abort(request_id, identity)

    def _take_kv_progress(self, message: protocol.KVProgress, identity: bytes) -> None:
        owner = self.proxies.owner(message.request_id)
        if owner is not None and owner != identity:
            self.control.rejects.reject("foreign_kv_progress", f"{short_id(identity)} sent KV progress of "
                                                               f"{message.request_id} of {short_id(owner)}")
            return
        try:
            self.handle_kv_progress(message)
        except ValueError as exc:
            self.fail_kv_progress(message, exc)

    def _admit(self, message) -> None:
        try:
            if isinstance(message, protocol.PrefillRequest):
                self.handle_prefill_request(message)
            else:
                self.handle_decode_request(message)
        except ValueError as exc:
            self.reply_error(message.request_id, exc, is_client_error=True)
        except Exception as exc:  # noqa: BLE001 - process edge: this request fails, the node serves on
            logger.exception("admitting request %s failed", message.request_id,
                             extra={"request_id": message.request_id})
            self.engine.abort(message.request_id)
            self.reply_error(message.request_id, exc, is_client_error=False)

    def _admit_compiled(self) -> None:
        """Admit the requests whose grammar is ready (or refused: admission answers that), and
        answer those the grammar gate gives up on."""
        ready, refused = self.grammar_gate.poll()
        for message in ready:
            self._admit(message)
        for refusal in refused:
            self.reply_failure(refusal.message.request_id, refusal.kind, refusal.text, refusal.is_client_error)

    def _has_work_beside_engine(self) -> bool:
        return self.has_pending_work() or len(self.grammar_gate) > 0

    def _step(self) -> None:
        waiting = self.metrics.waiting_ids(self.engine.scheduler.waiting)
        started_at = time.monotonic()
        try:
            outputs = self.engine.step()
        except EngineBroken as exc:
            logger.error("%s; ending every request (to run elsewhere) and stopping this node", exc)
            self._fail_all(exc, protocol.NODE_FAILED_ERROR_KIND)
            self.failure = exc
            self.stop()
            return
        except Exception as exc:  # noqa: BLE001 - scheduling itself failed: nothing to isolate
            logger.exception("engine step failed before running; failing its requests")
            self._fail_all(exc)
            return
        self.metrics.step_done(started_at, waiting, self.engine.scheduler.waiting, outputs, self._kv_outcomes)
        self.send_step_outputs(outputs)

    def _fail_all(self, exc: Exception, kind: str | None = None) -> None:
        """End every request with exc (its kind: the exception's class name unless given)."""
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            self.reply_failure(request_id, kind or type(exc).__name__, str(exc), is_client_error=False)

    def _end_orphans(self) -> None:
        """End the requests of proxies that vanished (silent past orphan_timeout_s) or that a
        send gave up on."""
        now = time.monotonic()
        if now < self._next_orphan_check_at and not self._unreachable:
            return
        self._next_orphan_check_at = now + _ORPHAN_CHECK_INTERVAL_S
        for identity in self.proxies.pop_silent(self.config.orphan_timeout_s):
            self._end_requests_of(identity, f"silent for {self.config.orphan_timeout_s:.0f} s", tell=True)
        for identity in list(self._unreachable):
            self.proxies.drop(identity)
            self._end_requests_of(identity, "unreachable", tell=False)
            self._unreachable.discard(identity)  # nothing of it is left; a send that fails again marks it again

    def _end_requests_of(self, identity: bytes, why: str, tell: bool) -> None:
        """End identity's requests and leases; tell: each ended request is answered with an
        ErrorReply too (a proxy judged silent may still be there: its client then gets an error,
        not silence; one a send gave up on would not read it)."""
        self.prefix_digests.forget(identity)
        request_ids = self.proxies.owned_by(identity)
        for request_id in request_ids:
            self.metrics.request_ended(request_id, "abort")
            self.forget(request_id)
            self.handle_abort(request_id, identity)
            if tell:
                self.send(identity, ErrorReply(request_id, "Orphaned", f"the node heard nothing from the proxy "
                                                                       f"for {self.config.orphan_timeout_s:.0f} s and "
                                                                       "ended the request", False))
        num_leases = self.release_owned(identity)
        num_ended = len(request_ids) + num_leases
        self.num_orphaned_requests += num_ended
        if num_ended:
            logger.warning("proxy %s %s: aborted %d requests, released %d leases", short_id(identity), why,
                           len(request_ids), num_leases)

    def _owner_of(self, out: StepOutput) -> bytes | None:
        if out.is_finished:
            return self.forget(out.request_id)
        return self.proxies.owner(out.request_id)

    def _record_load(self) -> None:
        """Snapshot the load for the heartbeat thread (the loop's state must not be read there)."""
        self._load = record_load(self, self._health.port if self._health is not None else 0)

    def _send_load_report(self, identity: bytes) -> None:
        self.send(identity, self._load.report_for(identity))

    def _send_heartbeats(self) -> None:
        while not self._is_stopping.wait(self.config.load_report_interval_s):
            load = self._load
            for identity in load.last_request_seqs:
                # NOTE: a report is state, superseded by the next: skipped (not waited for)
                # when the proxy's queue is full, so this thread never stalls the loop's sends.
                self.control.try_send(identity, protocol.encode(load.report_for(identity)))
