"""PrefillNode: the engine in the prefill role; finished prompts' blocks wait on a lease.

A prompt is prefilled (chunked and batched under the token budget), its first token sampled,
and the proxy gets a PrefillResult with a KV handle naming the lease (its generation and
timeout). The blocks stay allocated until the reader confirms its read or releases the lease
(over the KV side channel, answered from the lease table on the side channel's thread), the
proxy releases or aborts the request, the proxy vanishes, or the lease expires: lease_timeout_s
after it started or after the reader's last renewal (readers renew while they hold the request).

Streaming (PrefillRequest.stream_kv): a prompt prefilled in several chunks is leased from its
first chunk on. After each step whose chunk completed blocks, the proxy gets a KVProgress naming
them (a decode node may read them while later chunks run); the lease grows with each and takes
the blocks over when the prompt finishes, so the PrefillResult's handle has the same generation.
Until then the blocks stay the engine's: a lease that ends hands none back. A preemption frees
them, so it ends the stream's lease (a reader's confirmation then fails), and the finished prompt
gets a new lease, as does one whose stream's lease ended first (released or expired).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine import protocol
from engine.engine import LLMEngine, StepOutput
from engine.protocol import Role
from engine.request import FinishReason
from kv_transfer.base import KVConnector
from kv_transfer.lease import LeaseTable
from node.config import ServerConfig
from node.server import NodeServer
from node.transfer import kv_layout_info

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A prompt whose KV is streamed: its lease once taken, and how far it was announced."""

    generation: int | None = None
    num_preemptions: int = 0
    num_sent: int = 0  # blocks named in KVProgress so far


class PrefillNode(NodeServer):
    role = Role.PREFILL

    def __init__(self, engine: LLMEngine, config: ServerConfig, connector: KVConnector,
                 lease_timeout_s: float) -> None:
        super().__init__(engine, config)
        self.connector = connector
        self.leases = LeaseTable(lease_timeout_s, time.monotonic)
        connector.serve_leases(self.leases)
        self.num_expired_leases = 0
        self._layout_info = kv_layout_info(connector.layout)
        self._streams: dict[str, _Stream] = {}
        # NOTE: a GPU step of several ranks would need each rank's KV writes waited for.
        self.can_stream = engine.config.tensor_parallel_size == 1 or engine.config.device == "cpu"
        self.num_streamed_prompts = 0

    def handle_prefill_request(self, message: protocol.PrefillRequest) -> None:
        self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, None)
        if message.stream_kv and self.can_stream and message.request_id in self.engine.request_ids():
            self._streams[message.request_id] = _Stream()

    def handle_abort(self, request_id: str, identity: bytes) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        self._release(request_id, identity)

    def handle_release(self, request_id: str, identity: bytes) -> None:
        self._release(request_id, identity)

    def release_owned(self, identity: bytes) -> int:
        ended = self.leases.release_owned(identity)
        for _, block_ids in ended:
            self.engine.free_blocks(block_ids)
        return len(ended)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.leases

    def has_pending_work(self) -> bool:
        return len(self.leases) > 0

    def poll_transfers(self) -> None:
        for _, block_ids in self.leases.pop_ended():
            self.engine.free_blocks(block_ids)
        for request_id, block_ids in self.leases.pop_expired():
            self.num_expired_leases += 1
            logger.warning("lease of request %s expired: freeing %d blocks", request_id, len(block_ids),
                           extra={"request_id": request_id})
            self.engine.free_blocks(block_ids)

    def send_step_outputs(self, outputs: list[StepOutput]) -> None:
        self._send_results(outputs)
        self._send_progress()

    def _send_results(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            stream = self._streams.pop(out.request_id, None)
            if out.error is not None:
                self._end_stream(out.request_id, stream)
                self.reply_failure(out.request_id, "StepFailed", out.error, is_client_error=False)
                continue
            owner = self.forget(out.request_id)
            if not is_prefilled(out) or owner is None:
                self._end_stream(out.request_id, stream)
            if is_prefilled(out) and owner is None:  # aborted while finishing: nobody will pull it
                self.engine.free_blocks(out.block_ids)
                continue
            if owner is None:
                continue
            handle = self._lease(out, owner, stream) if is_prefilled(out) else None
            reason = None if is_prefilled(out) else out.finish_reason.value
            result = protocol.PrefillResult(out.request_id, out.new_tokens[0], out.num_prompt_tokens,
                                            kv_handle=handle, finish_reason=reason,
                                            prompt_logprobs=out.prompt_logprobs)
            self.send(owner, result)

    def load_extras(self) -> dict:
        return {"num_leases": len(self.leases), "num_kv_streamed": self.num_streamed_prompts}

    def kv_layout_info(self) -> protocol.KVLayoutInfo:
        return self._layout_info

    @property
    def num_rejected_messages(self) -> int:
        return super().num_rejected_messages + self.connector.num_rejected_messages

    def close(self) -> None:
        for request_id in self.leases.request_ids():
            self._release(request_id)
        self.connector.close()
        super().close()

    def _send_progress(self) -> None:
        """Tell the proxies of streamed prompts the blocks their last step completed."""
        is_synced = False
        for request_id, stream in list(self._streams.items()):
            progress = self.engine.prompt_progress(request_id)
            owner = self.proxies.owner(request_id)
            if progress is None or owner is None:
                continue
            if progress.num_preemptions != stream.num_preemptions:
                if stream.generation is not None:
                    # NOTE: its blocks were freed and may hold another prompt's KV by now: the
                    # lease ends, so no reader's confirmation vouches for what it read.
                    self.leases.release(request_id)
                    del self._streams[request_id]
                    logger.info("request %s was preempted: its KV stream ends; the whole prompt gets a new lease",
                                request_id, extra={"request_id": request_id})
                    continue
                stream.num_preemptions = progress.num_preemptions
            block_ids = progress.final_block_ids
            if len(block_ids) <= stream.num_sent:
                continue
            if not is_synced:
                self.engine.wait_for_kv_writes()  # a reader may start on them once told
                is_synced = True
            if stream.generation is None:
                stream.generation = self.leases.add(request_id, block_ids, owner, owns_blocks=False)
                self.num_streamed_prompts += 1
            elif not self.leases.grow(request_id, stream.generation, block_ids):
                del self._streams[request_id]  # its lease ended (released or expired): no more progress
                continue
            stream.num_sent = len(block_ids)
            handle = self._handle(block_ids, len(block_ids) * self.engine.block_size, stream.generation)
            self.send(owner, protocol.KVProgress(request_id, handle))

    def _end_stream(self, request_id: str, stream: _Stream | None) -> None:
        """End a stream's lease whose prompt will not be pulled (its blocks stay the engine's)."""
        if stream is not None and stream.generation is not None:
            self.leases.release(request_id)

    def _lease(self, out: StepOutput, owner: bytes, stream: _Stream | None = None) -> protocol.KVHandle:
        """Hold a prefilled request's blocks for its reader (on its stream's lease when that
        held); its handle."""
        request_id = out.request_id
        generation = stream.generation if stream is not None else None
        if generation is None or not self._hand_over(request_id, generation, out.block_ids):
            if generation is not None:
                self.leases.release(request_id)
            generation = self.leases.add(request_id, out.block_ids, owner)
        self.metrics.lease_started(request_id)
        return self._handle(out.block_ids, out.num_prompt_tokens, generation)

    def _hand_over(self, request_id: str, generation: int, block_ids: list[int]) -> bool:
        """Give a finished stream's lease its prompt's blocks; False if the lease ended, or (never
        expected: preemption ends the stream) its blocks are not where the prompt's begin."""
        try:
            return self.leases.grow(request_id, generation, block_ids, owns_blocks=True)
        except ValueError as exc:
            logger.error("request %s: %s; the whole prompt gets a new lease", request_id, exc,
                         extra={"request_id": request_id})
            return False

    def _handle(self, block_ids: list[int], num_tokens: int, generation: int) -> protocol.KVHandle:
        return protocol.KVHandle(engine_id=self.connector.engine_id, agent_address=self.connector.agent_address,
                                 block_ids=list(block_ids), num_tokens=num_tokens, generation=generation,
                                 lease_timeout_s=self.leases.lease_timeout_s)

    def _release(self, request_id: str, owner: bytes | None = None) -> None:
        block_ids = self.leases.release(request_id, owner)
        if block_ids is not None:
            self.engine.free_blocks(block_ids)


def is_prefilled(out: StepOutput) -> bool:
    return out.finish_reason is FinishReason.PREFILLED
