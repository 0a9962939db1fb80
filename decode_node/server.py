"""DecodeNode: pulls prompts' KV from prefill nodes and runs continuous-batched decode.

A request with a KV handle waits until enough local blocks are free (natural back-pressure),
then its blocks are pulled with one read; on success it joins the running batch, on failure it
falls back to prefilling locally (counted and logged). Every exit path tells the prefill node,
so its lease never waits for its timeout in normal operation. A request without a handle (the
proxy chose to prefill it here) is prefilled locally.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from engine import protocol
from engine.engine import LLMEngine
from engine.protocol import Role, num_blocks_for
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVConnector
from node.server import NodeServer, ServerConfig

logger = logging.getLogger(__name__)


@dataclass
class _Pull:
    message: protocol.DecodeRequest
    params: SamplingParams
    local_block_ids: list[int]


class DecodeNode(NodeServer):
    role = Role.DECODE

    def __init__(self, engine: LLMEngine, config: ServerConfig, connector: KVConnector) -> None:
        super().__init__(engine, config)
        self.connector = connector
        self._admission: deque[tuple[protocol.DecodeRequest, SamplingParams]] = deque()
        self._pulls: dict[str, _Pull] = {}

    def handle_decode_request(self, message: protocol.DecodeRequest) -> None:
        if message.kv_handle is None:
            self.add_local_request(message.request_id, message.prompt_token_ids, message.sampling, message.first_token)
            return
        try:
            params = self._check_pull_request(message)
        except ValueError:
            self._release_remote(message)
            raise
        self._admission.append((message, params))

    def handle_abort(self, request_id: str) -> None:
        for idx, (message, _) in enumerate(self._admission):
            if message.request_id == request_id:
                del self._admission[idx]
                self._release_remote(message)
                return
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            self.connector.abort_read(request_id)
            self.engine.free_blocks(pull.local_block_ids)
            self._release_remote(pull.message)
            return
        self.engine.abort(request_id)

    def has_pending_work(self) -> bool:
        return bool(self._admission or self._pulls)

    def poll_transfers(self) -> None:
        self._start_pulls()
        for result in self.connector.poll():
            pull = self._pulls.pop(result.request_id, None)
            if pull is None:
                continue
            if result.is_ok:
                self._join_batch(pull)
            else:
                self._fall_back(pull, result.error)

    def load_extras(self) -> dict:
        return {"num_pending_pulls": len(self._pulls) + len(self._admission)}

    def close(self) -> None:
        for message, _ in self._admission:
            self._release_remote(message)
        for request_id in list(self._pulls):
            self.handle_abort(request_id)
        self.connector.close()
        super().close()

    def _check_pull_request(self, message: protocol.DecodeRequest) -> SamplingParams:
        if message.first_token is None:
            raise ValueError(f"request {message.request_id}: a KV handle needs the first token")
        handle = message.kv_handle
        num_needed = num_blocks_for(len(message.prompt_token_ids), self.engine.block_size)
        if handle.num_tokens != len(message.prompt_token_ids) or len(handle.block_ids) != num_needed:
            raise ValueError(
                f"request {message.request_id}: KV handle has {handle.num_tokens} tokens in "
                f"{len(handle.block_ids)} blocks for a prompt of {len(message.prompt_token_ids)} tokens"
            )
        # Validates the prompt and the parameters (logit_bias ids, the grammar and the first token
        # under it) before any block is taken.
        params = SamplingParams.from_options(message.sampling)
        self.engine.check_request(message.request_id, message.prompt_token_ids, params,
                                  [message.first_token.token_id])
        return params

    def _start_pulls(self) -> None:
        max_seqs = self.engine.config.scheduler.max_num_seqs
        while self._admission and self.engine.num_unfinished + len(self._pulls) < max_seqs:
            message, params = self._admission[0]
            local_ids = self.engine.block_pool.allocate(len(message.kv_handle.block_ids))
            if local_ids is None:
                return  # back-pressure: wait until running requests free blocks
            self._admission.popleft()
            handle = message.kv_handle
            self._pulls[message.request_id] = _Pull(message, params, local_ids)
            self.connector.start_read(message.request_id, handle.engine_id, handle.agent_address,
                                      handle.block_ids, local_ids)

    def _join_batch(self, pull: _Pull) -> None:
        message = pull.message
        try:
            self.engine.add_prefilled_request(message.request_id, message.prompt_token_ids, pull.params,
                                              message.first_token, pull.local_block_ids)
        except ValueError as exc:
            self.engine.free_blocks(pull.local_block_ids)
            self.reply_error(message.request_id, exc, is_client_error=True)

    def _fall_back(self, pull: _Pull, error: str | None) -> None:
        """The pull failed: free its blocks, tell the prefill node, prefill here instead."""
        message = pull.message
        self.engine.free_blocks(pull.local_block_ids)
        self._release_remote(message)
        self.num_kv_fallbacks += 1
        logger.warning("KV pull for request %s failed (%s): prefilling locally", message.request_id, error)
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, pull.params,
                                    output_token_ids=[message.first_token.token_id])
        except ValueError as exc:
            self.reply_error(message.request_id, exc, is_client_error=True)

    def _release_remote(self, message: protocol.DecodeRequest) -> None:
        if message.kv_handle is None:
            return
        handle = message.kv_handle
        self.connector.release_remote(message.request_id, handle.engine_id, handle.agent_address)
