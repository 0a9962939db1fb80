"""ModelRunner: turns a SchedulerOutput into the flattened batch's tensors and runs the model."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from engine.decode_graphs import DecodeGraphs
from engine.mixed_graphs import MixedGraphs
from engine.model import AttentionMetadata, CausalLM
from engine.request import Request
from engine.sampler import is_plain_greedy, to_device
from engine.scheduler import SchedulerOutput
from engine.tp_ranks import TPRanks


@dataclass
class PromptSpan:
    """Prompt positions [first_idx, first_idx + num_positions) of one request in this step,
    whose logits give the logprobs of prompt tokens first_idx + 1 onward (prompt_logprobs)."""

    request: Request
    first_idx: int
    num_positions: int
    logits: torch.Tensor | None = None  # [num_positions, vocab] float32, once the step ran


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled + sum of spans' positions]: sampled rows first
    sampled_requests: list[Request]  # in the order of logits_indices
    prompt_spans: list[PromptSpan]  # their rows follow the sampled ones, in this order


@dataclass
class StepLogits:
    # [num rows, vocab] (the model's dtype): the last token's logits of each sampling request
    # but those in greedy_rows; None when there are none
    logits: torch.Tensor | None
    sampled_requests: list[Request]
    prompt_spans: list[PromptSpan]  # with their logits
    # Positions in sampled_requests of the plain greedy requests (is_plain_greedy) whose tokens
    # the model's greedy head gave without their logits, ascending, and those tokens (int64)
    greedy_rows: list[int] = field(default_factory=list)
    greedy_tokens: torch.Tensor | None = None

    @property
    def logits_requests(self) -> list[Request]:
        """The requests of logits' rows, in order."""
        if not self.greedy_rows:
            return self.sampled_requests
        greedy = set(self.greedy_rows)
        return [r for i, r in enumerate(self.sampled_requests) if i not in greedy]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, device: str,
                 graphs: DecodeGraphs | None = None, ranks: TPRanks | None = None,
                 mixed: MixedGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.graphs = graphs  # pure decode steps run there when it takes them
        self.ranks = ranks  # a tensor-parallel engine's other ranks: each step is theirs too
        self.mixed = mixed  # the other steps run there when it takes their tokens

    def execute(self, scheduled: SchedulerOutput) -> StepLogits:
        """Run one step; returns the logits of the requests that sample (those whose last
        scheduled token is their last token; partial chunks sample not) and of the prompt
        positions whose logprobs are owed (Request.needs_prompt_logprobs)."""
        if self.graphs is not None and self.graphs.takes(scheduled.decodes, len(scheduled.prefills)):
            return self._execute_decodes(scheduled.decodes)
        host = self._prepare_host(scheduled)
        greedy_rows = ([i for i, r in enumerate(host.sampled_requests) if is_plain_greedy(r)]
                       if self.model.has_greedy_head else [])
        if self.mixed is not None and self.mixed.takes(host.input_ids.shape[0]):
            batch = self._to_device(host, attention_only=True)  # NOTE: input ids, positions, slots stay here
            every_row = self.mixed.run(batch.input_ids, batch.meta)
            tokens, logits = self._head(every_row.index_select(0, batch.logits_indices), greedy_rows)
        else:
            with self.ranks.step(host.input_ids, host.meta, host.logits_indices) if self.ranks else nullcontext():
                batch = self._to_device(host)
                hidden = self.model.forward(batch.input_ids, batch.meta, self.kv_cache, batch.logits_indices)
                tokens, logits = self._head(hidden, greedy_rows)
        num_sampled = len(batch.sampled_requests) - len(greedy_rows)  # logits' rows of sampled requests
        offset = num_sampled
        for span in batch.prompt_spans:
            span.logits = logits[offset : offset + span.num_positions]
            offset += span.num_positions
        sampled_logits = logits[:num_sampled] if num_sampled else None
        return StepLogits(sampled_logits, batch.sampled_requests, batch.prompt_spans, greedy_rows, tokens)

    def _execute_decodes(self, decodes: list[Request]) -> StepLogits:
        """A pure decode step on the static buffers: the plain greedy rows take the step's argmax,
        the others their logits (the sampler's work, after the step)."""
        with self.ranks.guard() if self.ranks else nullcontext():
            out = self.graphs.run(decodes)
        greedy_rows = [i for i, r in enumerate(decodes) if is_plain_greedy(r)]
        if len(greedy_rows) == len(decodes):
            return StepLogits(None, decodes, [], greedy_rows, out.tokens)
        if not greedy_rows:
            return StepLogits(out.logits, decodes, [])
        picked, others = _split_rows(greedy_rows, len(decodes), out.logits.device)
        return StepLogits(out.logits[others], decodes, [], greedy_rows, out.tokens[picked])

    def _head(self, hidden: torch.Tensor, greedy_rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the greedy head's tokens for greedy_rows, the logits of the other rows in order; None
        where there are none)."""
        if not greedy_rows:
            return None, self.model.logits(hidden)
        if len(greedy_rows) == hidden.shape[0]:
            return self.model.greedy_tokens(hidden), None
        picked, others = _split_rows(greedy_rows, hidden.shape[0], hidden.device)
        return self.model.greedy_tokens(hidden[picked]), self.model.logits(hidden[others])

    def _prepare_host(self, scheduled: SchedulerOutput) -> BatchInputs:
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
        prompt_spans, prompt_indices = _prompt_spans(requests, starts, num_new, cu_lens.tolist())
        logits_indices = cu_lens[1:][sampled_idx] - 1
        if prompt_indices:
            logits_indices = torch.cat([logits_indices, torch.tensor(prompt_indices, dtype=torch.long)])
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
            logits_block_tables=block_tables[request_idx[logits_indices]],
            logits_seq_lens=(positions[logits_indices] + 1).to(torch.int32),
            prefill_max_query_len=max(num_new[num_decodes:], default=0),
        )
        batch = BatchInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            meta=meta,
            logits_indices=logits_indices,
            sampled_requests=[requests[i] for i in sampled_idx],
            prompt_spans=prompt_spans,
        )
        return batch

    def _block_tables(self, requests: list[Request]) -> torch.Tensor:
        width = max(len(r.block_ids) for r in requests)
        rows = [r.block_ids + [0] * (width - len(r.block_ids)) for r in requests]
        return torch.tensor(rows, dtype=torch.int32)

    def _to_device(self, batch: BatchInputs, attention_only: bool = False) -> BatchInputs:
        """The batch's tensors on the device; attention_only: what the attention and the row
        selection read (mixed graphs stage the tokens, positions and slots themselves)."""
        if self.device == "cpu":
            return batch
        meta = batch.meta
        names = ("decode_block_tables", "decode_seq_lens", "prefill_block_tables", "prefill_cu_query_lens",
                 "prefill_seq_lens")
        if not attention_only:
            names += ("positions", "slot_mapping", "logits_block_tables", "logits_seq_lens")
            batch.input_ids = batch.input_ids.to(self.device, non_blocking=True)
        for name in names:
            setattr(meta, name, getattr(meta, name).to(self.device, non_blocking=True))
        batch.logits_indices = batch.logits_indices.to(self.device, non_blocking=True)
        return batch


def _prompt_spans(
    requests: list[Request], starts: list[int], num_new: list[int], cu_lens: list[int]
) -> tuple[list[PromptSpan], list[int]]:
    """The prompt positions of this step whose logits prompt logprobs still need, and their
    indices in the flattened batch. Position p predicts prompt token p + 1, so the last prompt
    position (it predicts the first output token) is never one; positions already gathered
    before a preemption are not recomputed."""
    spans, indices = [], []
    for idx, (request, start, n) in enumerate(zip(requests, starts, num_new)):
        if not request.needs_prompt_logprobs:
            continue
        first = max(start, len(request.prompt_logprobs) - 1)
        end = min(start + n, request.num_prompt_tokens - 1)
        if first >= end:
            continue
        spans.append(PromptSpan(request, first, end - first))
        indices.extend(range(cu_lens[idx] + first - start, cu_lens[idx] + end - start))
    return spans, indices


def _split_rows(greedy_rows: list[int], num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy_rows, the other rows in order) as index tensors on device, sent without waiting for it:
    indices, not a mask (a boolean mask on a GPU waits for the device to count its rows)."""
    greedy = set(greedy_rows)
    others = [i for i in range(num_rows) if i not in greedy]
    return to_device(greedy_rows, torch.long, device), to_device(others, torch.long, device)
