"""PrefillNode: the engine in the prefill role; finished prompts' blocks wait on a lease.

A prompt is prefilled (chunked and batched under the token budget), its first token sampled,
and the proxy gets a PrefillResult with a KV handle naming the lease (its generation and
timeout). The blocks stay allocated until the reader confirms its read or releases the lease
(over the KV side channel, answered from the lease table on the side channel's thread), the
proxy releases or aborts the request, the proxy vanishes, or the lease expires: lease_timeout_s
after it started or after the reader's last renewal (readers renew while they hold the request).
"""

from __future__ import annotations

import logging
import time

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

    def handle_prefill_request(self, message: protocol.PrefillRequest) -> None:
        self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, None)

    def handle_abort(self, request_id: str, identity: bytes) -> None:
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
        for out in outputs:
            if out.error is not None:
                self.reply_failure(out.request_id, "StepFailed", out.error, is_client_error=False)
                continue
            owner = self.forget(out.request_id)
            if is_prefilled(out) and owner is None:  # aborted while finishing: nobody will pull it
                self.engine.free_blocks(out.block_ids)
                continue
            if owner is None:
                continue
            handle = self._lease(out, owner) if is_prefilled(out) else None
            reason = None if is_prefilled(out) else out.finish_reason.value
            result = protocol.PrefillResult(out.request_id, out.new_tokens[0], out.num_prompt_tokens,
                                            kv_handle=handle, finish_reason=reason,
                                            prompt_logprobs=out.prompt_logprobs)
            self.send(owner, result)

    def load_extras(self) -> dict:
        return {"num_leases": len(self.leases)}

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

    def _lease(self, out: StepOutput, owner: bytes) -> protocol.KVHandle:
        """Hold a prefilled request's blocks for its reader; its handle."""
        generation = self.leases.add(out.request_id, out.block_ids, owner)
        self.metrics.lease_started(out.request_id)
        return protocol.KVHandle(engine_id=self.connector.engine_id, agent_address=self.connector.agent_address,
                                 block_ids=out.block_ids, num_tokens=out.num_prompt_tokens, generation=generation,
                                 lease_timeout_s=self.leases.lease_timeout_s)

    def _release(self, request_id: str, owner: bytes | None = None) -> None:
        block_ids = self.leases.release(request_id, owner)
        if block_ids is not None:
            self.engine.free_blocks(block_ids)


def is_prefilled(out: StepOutput) -> bool:
    return out.finish_reason is FinishReason.PREFILLED
