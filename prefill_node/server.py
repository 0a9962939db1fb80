"""PrefillNode: the engine in the prefill role; finished prompts' blocks wait on a lease.

A prompt is prefilled (chunked and batched under the token budget), its first token sampled,
and the proxy gets a PrefillResult with a KV handle. The blocks stay allocated until the decode
node reports it has read them, the proxy releases or aborts the request, or the lease expires.
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
from node.server import NodeServer, ServerConfig

logger = logging.getLogger(__name__)


class PrefillNode(NodeServer):
    role = Role.PREFILL

    def __init__(self, engine: LLMEngine, config: ServerConfig, connector: KVConnector,
                 lease_timeout_s: float) -> None:
        super().__init__(engine, config)
        self.connector = connector
        self.leases = LeaseTable(lease_timeout_s, time.monotonic)
        self.num_expired_leases = 0

    def handle_prefill_request(self, message: protocol.PrefillRequest) -> None:
        self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, None)

    def handle_abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._release(request_id)

    def handle_release(self, request_id: str) -> None:
        self._release(request_id)

    def has_pending_work(self) -> bool:
        return len(self.leases) > 0

    def poll_transfers(self) -> None:
        for request_id in self.connector.poll_released():
            self._release(request_id)
        for request_id, block_ids in self.leases.pop_expired(time.monotonic()):
            self.num_expired_leases += 1
            logger.warning("lease of request %s expired: freeing %d blocks", request_id, len(block_ids))
            self.engine.free_blocks(block_ids)

    def send_step_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            owner = self.forget(out.request_id)
            handle = None
            if is_prefilled(out):
                handle = protocol.KVHandle(
                    engine_id=self.connector.engine_id,
                    agent_address=self.connector.agent_address,
                    block_ids=out.block_ids,
                    num_tokens=out.num_prompt_tokens,
                )
                if owner is None:  # aborted while finishing: nobody will pull it
                    self.engine.free_blocks(out.block_ids)
                    continue
                self.leases.add(out.request_id, out.block_ids)
            if owner is None:
                continue
            reason = None if is_prefilled(out) else out.finish_reason.value
            result = protocol.PrefillResult(out.request_id, out.new_tokens[0], out.num_prompt_tokens,
                                            kv_handle=handle, finish_reason=reason,
                                            prompt_logprobs=out.prompt_logprobs)
            self.send(owner, result)

    def load_extras(self) -> dict:
        return {"num_leases": len(self.leases)}

    def close(self) -> None:
        for request_id in self.leases.request_ids():
            self._release(request_id)
        self.connector.close()
        super().close()

    def _release(self, request_id: str) -> None:
        block_ids = self.leases.release(request_id)
        if block_ids is not None:
            self.engine.free_blocks(block_ids)


def is_prefilled(out: StepOutput) -> bool:
    return out.finish_reason is FinishReason.PREFILLED
