"""ModelRunner: turns a SchedulerOutput into the flattened batch's tensors and runs the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import AttentionMetadata, CausalLM
from engine.request import Request
from engine.scheduler import SchedulerOutput


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: last token of each request that samples
    sampled_requests: list[Request]  # in the order of logits_indices


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, device: str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    def execute(self, scheduled: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run one step; returns logits [num_sampled, vocab] and the requests they belong to
        (requests whose last scheduled token is their last token; partial chunks sample not)."""
        batch = self.prepare(scheduled)
        logits = self.model.forward(batch.input_ids, batch.meta, self.kv_cache, batch.logits_indices)
        return logits, batch.sampled_requests

    def prepare(self, scheduled: SchedulerOutput) -> BatchInputs:
        items = scheduled.scheduled()
        requests = [r for r, _ in items]
        num_new = [n for _, n in items]
        starts = [r.num_computed_tokens for r in requests]
        token_ids: list[int] = []
        for request, start, n in zip(requests, starts, num_new):
            token_ids.extend(request.token_ids_slice(start, start + n))

        num_new_t = torch.tensor(num_new, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        cu_lens = torch.zeros(len(items) + 1, dtype=torch.long)
        torch.cumsum(num_new_t, 0, out=cu_lens[1:])
        num_tokens = int(cu_lens[-1])
        request_idx = torch.repeat_interleave(torch.arange(len(items)), num_new_t, output_size=num_tokens)
        positions = starts_t[request_idx] + torch.arange(num_tokens) - cu_lens[:-1][request_idx]
        block_tables = self._block_tables(requests)
        block_numbers = block_tables.long()[request_idx, positions // self.block_size]
        slot_mapping = block_numbers * self.block_size + positions % self.block_size
        seq_lens = (starts_t + num_new_t).to(torch.int32)

        is_sampled = [start + n == r.num_tokens for r, start, n in zip(requests, starts, num_new)]
        sampled_idx = [i for i, flag in enumerate(is_sampled) if flag]
        logits_indices = cu_lens[1:][sampled_idx] - 1
        num_decodes = len(scheduled.decodes)
        prefill_cu = (cu_lens[num_decodes:] - cu_lens[num_decodes]).to(torch.int32)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=block_tables[:num_decodes],
            decode_seq_lens=seq_lens[:num_decodes],
            prefill_block_tables=block_tables[num_decodes:],
            prefill_cu_query_lens=prefill_cu,
            prefill_seq_lens=seq_lens[num_decodes:],
        )
        batch = BatchInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            meta=meta,
            logits_indices=logits_indices,
            sampled_requests=[requests[i] for i in sampled_idx],
        )
        return self._to_device(batch)

    def _block_tables(self, requests: list[Request]) -> torch.Tensor:
        width = max(len(r.block_ids) for r in requests)
        rows = [r.block_ids + [0] * (width - len(r.block_ids)) for r in requests]
        return torch.tensor(rows, dtype=torch.int32)

    def _to_device(self, batch: BatchInputs) -> BatchInputs:
        if self.device == "cpu":
            return batch
        meta = batch.meta
        for name in ("positions", "slot_mapping", "decode_block_tables", "decode_seq_lens",
                     "prefill_block_tables", "prefill_cu_query_lens", "prefill_seq_lens"):
            setattr(meta, name, getattr(meta, name).to(self.device, non_blocking=True))
        batch.input_ids = batch.input_ids.to(self.device, non_blocking=True)
        batch.logits_indices = batch.logits_indices.to(self.device, non_blocking=True)
        return batch
