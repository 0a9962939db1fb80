"""Request: one sequence's state inside an engine (tokens, blocks, progress, finish)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.protocol import TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import RequestGrammar


_serials = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill role: first token sampled, blocks handed to the caller
    ERROR = "error"  # its step raised (see LLMEngine.step); never sent as a finish reason


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output never exceeds this (max_model_len)
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    grammar: RequestGrammar | None = None  # structured output's matcher; dropped when finished
    # Prompt logprobs gathered so far (entry i: prompt token i), while they are owed: None when
    # not asked for, or once handed out with the first token.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Prefix cache: the keys of the full blocks of prompt + output hashed so far
    # (protocol.prefix_block_hashes), the cache entry each of the leading blocks stands for
    # (registered or matched; emptied with the blocks), and whether caching stopped for it (a
    # colliding key in use). num_cached_tokens: tokens found cached at its first admission.
    block_hashes: list[int] = field(default_factory=list)
    cache_entries: list[int] = field(default_factory=list)
    is_caching_stopped: bool = False
    num_cached_tokens: int = 0
    # Unique in the process (request ids may come back once a request ended): what the static
    # decode buffers know a row's block table by (engine.decode_graphs).
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
