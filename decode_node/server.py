"""DecodeNode: pulls prompts' KV from prefill nodes and runs continuous-batched decode.

A request with a KV handle is held (its lease renewed by the connector) from admission on,
waits until enough local blocks are free (natural back-pressure), then its blocks are pulled
with one read, which succeeds only once the prefill node confirms that the lease held
throughout. On success it joins the running batch. On a transient failure (handshake, transfer,
timeout, a lease that ended first) it falls back to prefilling locally, counted per reason; on a
layout mismatch or a malformed handle it fails with an error: those never heal by retrying.
Every exit path tells the prefill node, so its lease never waits for its timeout in normal
operation. A request without a handle (the proxy chose to prefill it here) is prefilled locally.

Prefix cache: when a pulled request is admitted, the node takes the prompt's longest prefix of
full blocks cached here and pulls only the handle's blocks past it (a follow-up turn pulls its new
blocks). When every full block is cached (a full hit) nothing is pulled: the lease is released at
once and the partial last block, if any (< block_size tokens), is computed here with the first
token's step. Cached blocks a pull builds on hold a reference until the request ends, so they
are never evicted under it; pulled full blocks are cached once the read is confirmed.

Streamed pulls (a handle without a first token: protocol.KVProgress): the request takes its
blocks for the whole prompt when admitted, then reads each range of blocks its prefill node has
completed as KVProgress messages name them, one read at a time, none confirmed; the last read,
of the rest once the first token and the whole-prompt handle came, is confirmed, and that
confirmation vouches for every part (the lease held throughout). A handle of another
generation (the prefill restarted) discards what was read; a part that fails is read again with
the rest, and only that last read's failure falls back.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace

from engine import protocol
from engine.engine import LLMEngine
from engine.protocol import KVFallbackReason, KVOutcome, KVSource, Role, num_blocks_for
from engine.sampling_params import SamplingParams
from kv_transfer.base import FailureCode, KVConnector, ReadResult, RemoteLease, check_address
from node.config import ServerConfig
from node.server import NodeServer
from node.transfer import kv_layout_info

logger = logging.getLogger(__name__)

# Read failures that end the request with an error instead of a local prefill.
_REFUSALS = {FailureCode.LAYOUT_MISMATCH: "LayoutMismatch", FailureCode.BAD_BLOCKS: "BadKVHandle"}


@dataclass
class _Pull:
    message: protocol.DecodeRequest
    params: SamplingParams
    lease: RemoteLease  # a stream's grows with each KVProgress
    first_token: protocol.TokenLogprob | None  # None: the prompt's KV is still streaming in
    local_block_ids: list[int] | None = None  # set once the read started (a stream's: once admitted)
    cached_block_ids: list[int] = field(default_factory=list)  # the prompt's blocks found cached here
    # A stream's progress: prompt blocks [0, num_done) hold the KV of lease generation
    # done_generation (unconfirmed; cached blocks count as done), and the part read in flight.
    num_done: int = 0
    done_generation: int = 0
    part: tuple[int, int, int] | None = None  # (generation, first block, end) of the part read in flight
    is_part_failed: bool = False  # a part read failed: the rest is read in one, once the first token came
    failure: ReadResult | None = None  # a stream's read that failed for good: it falls back once the first token came

    @property
    def block_ids(self) -> list[int]:
        """Every block the pull holds here, in prompt order."""
        return self.cached_block_ids + (self.local_block_ids or [])

    @property
    def is_streaming(self) -> bool:
        return self.first_token is None


class DecodeNode(NodeServer):
    role = Role.DECODE

    def __init__(self, engine: LLMEngine, config: ServerConfig, connector: KVConnector) -> None:
        super().__init__(engine, config)
        self.connector = connector
        self._admission: deque[_Pull] = deque()
        self._pulls: dict[str, _Pull] = {}
        # Aborted pulls whose transfer the connector could not stop yet: their blocks wait for
        # its word (a result for the request) before they are freed.
        self._held: dict[str, _Pull] = {}
        self.num_kv_blocks_lost = 0  # blocks of transfers that never stopped: out of use for good
        self._layout_info = kv_layout_info(connector.layout)
        self.num_kv_refusals = 0
        self.num_kv_blocks_pulled = 0
        self.num_kv_blocks_skipped = 0  # handle blocks not pulled: found in this node's prefix cache
        self.num_streamed_pulls = 0  # pulls that read part of the prompt while it was prefilled

    def handle_decode_request(self, message: protocol.DecodeRequest) -> None:
        if message.kv_handle is None:
            self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, message.first_token,
                                   output_token_ids=message.output_token_ids)
            return
        lease = _lease_of(message.kv_handle)
        try:
            params = self._check_pull_request(message)
        except ValueError:
            self._release_remote(message.request_id, lease)
            raise
        self.connector.hold(message.request_id, lease)
        self._admission.append(_Pull(message, params, lease, message.first_token))

    def handle_kv_progress(self, message: protocol.KVProgress) -> None:
        """More of a streamed prompt's KV (see the module docstring); raises ValueError for a
        handle that does not fit the request."""
        pull = self._pull_of(message.request_id)
        if pull is None:
            if message.request_id not in self.engine.request_ids():
                # NOTE: the request ended here (failed, aborted): nobody will read this lease.
                self._release_remote(message.request_id, _lease_of(message.kv_handle))
            return
        if not pull.is_streaming:
            return  # its last handle came already
        handle = message.kv_handle
        self._check_handle(pull.message, handle, is_final=message.first_token is not None)
        if message.first_token is not None:
            self.engine.check_request(pull.message.request_id, pull.message.prompt_token_ids, pull.params,
                                      [message.first_token.token_id])
            # NOTE: the node's request metrics (TTFT, queue time, e2e) count from here, as for a
            # whole-prompt pull: not from the first chunk, with the rest of the prefill in them.
            self.metrics.request_arrived(message.request_id)
        lease = _lease_of(handle)
        if lease.generation != pull.lease.generation:
            self.connector.hold(message.request_id, lease)  # the stream's lease ended with its old generation
        pull.lease, pull.first_token = lease, message.first_token
        if pull.local_block_ids is not None:
            self._advance(pull)

    def fail_kv_progress(self, message: protocol.KVProgress, exc: ValueError) -> None:
        """A KVProgress handle_kv_progress refused: the request ends with the error."""
        pull = self._pull_of(message.request_id)
        self._release_remote(message.request_id, _lease_of(message.kv_handle))
        if pull is not None and pull.is_streaming:
            self.handle_abort(message.request_id, b"")
            self.reply_error(message.request_id, exc, is_client_error=True)

    def handle_abort(self, request_id: str, identity: bytes) -> None:
        for idx, pull in enumerate(self._admission):
            if pull.message.request_id == request_id:
                del self._admission[idx]
                self._release_remote(request_id, pull.lease)
                return
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            if self.connector.abort_read(request_id):
                self.engine.free_blocks(pull.block_ids)
            else:
                self._held[request_id] = pull
            self._release_remote(request_id, pull.lease)
            return
        self.engine.abort(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._held  # NOTE: its read is still the connector's: the id is not free yet

    def has_pending_work(self) -> bool:
        return bool(self._admission or self._pulls or self._held)

    def needs_polling(self) -> bool:
        """Not for streams waiting for their next KVProgress (its arrival wakes the loop): a
        decode node would otherwise spin its loop through a long prompt's whole prefill."""
        return bool(self._admission or self._held or any(not p.is_streaming or p.part is not None
                                                         for p in self._pulls.values()))

    def wake_sockets(self) -> list:
        return self.connector.wake_sockets()

    def is_copying(self) -> bool:
        return self.connector.is_copying

    def poll_transfers(self) -> None:
        self._start_pulls()
        for result in self.connector.poll():
            held = self._held.pop(result.request_id, None)
            if held is not None:
                self._free_unless_lost(held, result)
                continue
            pull = self._pulls.get(result.request_id)
            if pull is None:
                continue
            if pull.part is not None and not result.blocks_held and result.failure not in _REFUSALS:
                self._part_done(pull, result)
                continue
            del self._pulls[result.request_id]
            if result.blocks_held:
                self._free_unless_lost(pull, result)
                pull.cached_block_ids, pull.local_block_ids = [], []  # NOTE: freed or lost just now
                if pull.is_streaming:  # no first token yet to continue from: falls back once it came
                    pull.part, pull.failure = None, result
                    self._pulls[result.request_id] = pull
                    continue
            if result.is_ok:
                self._join_batch(pull)
            elif result.failure in _REFUSALS:
                self._refuse(pull, result)
            else:
                self._fall_back(pull, result)

    def load_extras(self) -> dict:
        return {"num_pending_pulls": len(self._pulls) + len(self._admission),
                "num_kv_blocks_pulled": self.num_kv_blocks_pulled, "num_kv_blocks_skipped": self.num_kv_blocks_skipped,
                "num_kv_blocks_lost": self.num_kv_blocks_lost, "num_kv_streamed": self.num_streamed_pulls}

    def num_promised_blocks(self) -> int:
        """Also the prompts waiting for a pull (their blocks are taken when the pull starts)."""
        size = self.engine.block_size
        return super().num_promised_blocks() + sum(num_blocks_for(len(p.message.prompt_token_ids), size)
                                                   for p in self._admission)

    def kv_layout_info(self) -> protocol.KVLayoutInfo:
        return self._layout_info

    @property
    def num_rejected_messages(self) -> int:
        return super().num_rejected_messages + self.connector.num_rejected_messages

    def close(self) -> None:
        for pull in self._admission:
            self._release_remote(pull.message.request_id, pull.lease)
        self._admission.clear()
        for request_id in list(self._pulls):
            self.handle_abort(request_id, b"")
        self.connector.close()
        super().close()

    def _check_pull_request(self, message: protocol.DecodeRequest) -> SamplingParams:
        self._check_handle(message, message.kv_handle, is_final=message.first_token is not None)
        # Validates the prompt (its length bounds the block count by this node's cache) and the
        # parameters (logit_bias ids, the grammar and the first token under it) before any block
        # is taken.
        params = SamplingParams.from_options(message.sampling)
        first = [message.first_token.token_id] if message.first_token is not None else []
        self.engine.check_request(message.request_id, message.prompt_token_ids, params, first)
        return params

    def _check_handle(self, message: protocol.DecodeRequest, handle: protocol.KVHandle, is_final: bool) -> None:
        """Raises ValueError unless handle names the prompt's blocks (is_final), or, streamed,
        whole blocks short of its last."""
        check_address(handle.agent_address)
        size = self.engine.block_size
        num_prompt = len(message.prompt_token_ids)
        num_needed = num_blocks_for(num_prompt, size)
        if is_final:
            fits = handle.num_tokens == num_prompt and len(handle.block_ids) == num_needed
        else:
            fits = handle.num_tokens == len(handle.block_ids) * size and 0 < len(handle.block_ids) < num_needed
        if not fits:
            part = "" if is_final else "streamed "
            raise ValueError(
                f"request {message.request_id}: {part}KV handle has {handle.num_tokens} tokens in "
                f"{len(handle.block_ids)} blocks for a prompt of {num_prompt} tokens"
            )
        if handle.lease_timeout_s <= 0:
            raise ValueError(f"request {message.request_id}: KV handle has lease_timeout_s {handle.lease_timeout_s}")

    def _pull_of(self, request_id: str) -> _Pull | None:
        """request_id's pull, reading or queued for blocks; None if it has none here."""
        return self._pulls.get(request_id) or next((p for p in self._admission if p.message.request_id == request_id),
                                                   None)

    def _start_pulls(self) -> None:
        max_seqs = self.engine.config.scheduler.max_num_seqs
        while self._admission and self.engine.num_unfinished + len(self._pulls) < max_seqs:
            pull = self._admission[0]
            request_id, prompt = pull.message.request_id, pull.message.prompt_token_ids
            num_full = len(prompt) // self.engine.block_size
            cached = self.engine.acquire_cached_prefix(request_id, prompt, num_full)
            is_full_hit = num_full > 0 and len(cached) == num_full
            num_remote = num_blocks_for(len(prompt), self.engine.block_size)  # a stream's handle names fewer yet
            local_ids = [] if is_full_hit else self.engine.block_pool.allocate(num_remote - len(cached))
            if local_ids is None:
                self.engine.free_blocks(cached)
                return  # back-pressure: wait until running requests free blocks
            self._admission.popleft()
            self._count_pull(pull, len(cached), len(local_ids), num_remote)
            pull.cached_block_ids, pull.local_block_ids = cached, local_ids
            if is_full_hit:
                self._release_remote(request_id, pull.lease)  # nothing to read: the holder frees it now
                if pull.is_streaming:
                    self._pulls[request_id] = pull  # joins once its first token comes
                else:
                    self._join_batch(pull)
                continue
            self._pulls[request_id] = pull
            self.engine.wait_for_late_writes(local_ids)  # NIXL's copies are not ordered with the engine's steps
            if pull.is_streaming:
                self.num_streamed_pulls += 1
                pull.num_done, pull.done_generation = len(cached), pull.lease.generation
                self._advance(pull)
            else:
                self.connector.start_read(request_id, replace(pull.lease, block_ids=pull.lease.block_ids[len(cached):]),
                                          local_ids)

    def _advance(self, pull: _Pull) -> None:
        """Start a stream's next read, if it has none in flight: the blocks completed since the
        last part (not confirmed), or, once the first token came, the rest (confirmed); after a
        full prefix-cache hit, join once the first token came."""
        request_id = pull.message.request_id
        if pull.part is not None:
            return
        if pull.failure is not None:
            if not pull.is_streaming:
                self._pulls.pop(request_id, None)
                self._fall_back(pull, pull.failure)
            return
        if not pull.local_block_ids:  # a full hit: nothing to read
            if not pull.is_streaming:
                self._pulls.pop(request_id, None)
                self._release_remote(request_id, pull.lease)
                self._join_batch(pull)
            return
        lease = pull.lease
        if lease.generation != pull.done_generation:  # a new lease: what was read is not its data
            pull.num_done, pull.done_generation = len(pull.cached_block_ids), lease.generation
        end = len(lease.block_ids)
        if end <= pull.num_done or (pull.is_streaming and pull.is_part_failed):
            return
        start, num_cached = pull.num_done, len(pull.cached_block_ids)
        local = pull.local_block_ids[start - num_cached:end - num_cached]
        if pull.is_streaming:
            pull.part = (lease.generation, start, end)
        self.connector.start_read(request_id, replace(lease, block_ids=lease.block_ids[start:end]), local,
                                  confirm=not pull.is_streaming)

    def _free_unless_lost(self, pull: _Pull, result: ReadResult) -> None:
        """The connector is done with the pull's read: free its blocks, except, where its transfer
        never stopped (blocks_held), the ones it read into: those stay taken for good, so that a
        late write cannot land in another request's KV."""
        if not result.blocks_held:
            self.engine.free_blocks(pull.block_ids)
            return
        self.engine.free_blocks(pull.cached_block_ids)
        self.num_kv_blocks_lost += len(pull.local_block_ids or [])
        logger.error("request %s: %d KV blocks taken out of use (a transfer into them never stopped)",
                     result.request_id, len(pull.local_block_ids or []), extra={"request_id": result.request_id})

    def _part_done(self, pull: _Pull, result: ReadResult) -> None:
        """A stream's part read ended: what it read counts if it is still the stream's lease;
        a failed part is read again with the rest (whose read may fail the pull)."""
        generation, _, end = pull.part
        pull.part = None
        if result.is_ok and generation == pull.done_generation:
            pull.num_done = end
        elif not result.is_ok:
            pull.is_part_failed = True
            logger.info("KV stream of request %s: a part read failed (%s); it is read again with the rest",
                        result.request_id, result.error, extra={"request_id": result.request_id})
        self._advance(pull)

    def _count_pull(self, pull: _Pull, num_cached: int, num_pulled: int, num_remote: int) -> None:
        size = self.engine.block_size
        self.engine.count_prefix_lookup(len(pull.message.prompt_token_ids), num_cached * size)
        self.num_kv_blocks_pulled += num_pulled
        self.num_kv_blocks_skipped += num_remote - num_pulled

    def _join_batch(self, pull: _Pull) -> None:
        """The request runs here: with its whole prompt's KV (pulled), or, after a full hit, its
        cached full blocks (the rest of the prompt is computed with its first token)."""
        message = pull.message
        num_computed = None if pull.local_block_ids else len(pull.cached_block_ids) * self.engine.block_size
        try:
            self.engine.add_prefilled_request(message.request_id, message.prompt_token_ids, pull.params,
                                              pull.first_token, pull.block_ids, num_computed)
        except ValueError as exc:
            self.engine.free_blocks(pull.block_ids)
            self.reply_error(message.request_id, exc, is_client_error=True)
            return
        self.note_kv_outcome(message.request_id, KVOutcome(KVSource.PULLED))

    def _refuse(self, pull: _Pull, result: ReadResult) -> None:
        """The pair cannot exchange these blocks (another layout, block ids out of range): a
        configuration or peer bug that a retry would repeat, so the request fails loudly."""
        request_id = pull.message.request_id
        self.engine.free_blocks(pull.block_ids)
        self._release_remote(request_id, pull.lease)
        self.num_kv_refusals += 1
        logger.error("KV pull for request %s from %s refused: %s", request_id, pull.lease.address, result.error,
                     extra={"request_id": request_id})
        self.reply_failure(request_id, _REFUSALS[result.failure], result.error or "", is_client_error=False)

    def _fall_back(self, pull: _Pull, result: ReadResult) -> None:
        """The pull failed for a transient reason: free its blocks, tell the prefill node,
        prefill here instead."""
        message = pull.message
        reason = KVFallbackReason(result.failure.value)
        self.engine.free_blocks(pull.block_ids)  # its cached prefix stays cached: the local prefill reuses it
        self._release_remote(message.request_id, pull.lease)
        self.num_kv_fallbacks_by_reason[reason.value] = self.num_kv_fallbacks_by_reason.get(reason.value, 0) + 1
        logger.warning("KV pull for request %s failed (%s: %s): prefilling locally", message.request_id,
                       reason.value, result.error, extra={"request_id": message.request_id})
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, pull.params,
                                    output_token_ids=[pull.first_token.token_id])
        except ValueError as exc:
            self.reply_error(message.request_id, exc, is_client_error=True)
            return
        self.note_kv_outcome(message.request_id, KVOutcome(KVSource.FALLBACK, reason))

    def _release_remote(self, request_id: str, lease: RemoteLease) -> None:
        try:
            self.connector.release_remote(request_id, lease)
        except ValueError as exc:  # a malformed address: nothing to tell
            logger.warning("request %s: cannot release its lease: %s", request_id, exc,
                           extra={"request_id": request_id})


def _lease_of(handle: protocol.KVHandle) -> RemoteLease:
    return RemoteLease(handle.engine_id, handle.agent_address, list(handle.block_ids), handle.generation,
                       handle.lease_timeout_s)
