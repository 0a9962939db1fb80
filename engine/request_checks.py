"""What an engine refuses in a request (token ids, logit_bias, a grammar's schema and the outputs it
must accept), and the Request it makes of what it accepts."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.grammar import Grammars
from engine.protocol import TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParams


class RequestChecks:
    """Checks requests against one model's vocabulary and an engine's token limit."""

    def __init__(self, model: ModelConfig, max_total_tokens: int, grammars: Grammars) -> None:
        self.vocab_size = model.vocab_size
        self.max_total_tokens = max_total_tokens
        self.grammars = grammars

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None) -> Request:
        """The Request to queue (its grammar's matcher made and fed the outputs); ValueError as
        check_request."""
        outputs = list(output_token_ids or [])
        self.check_token_ids(request_id, prompt_token_ids, outputs)
        self.check_logit_bias(request_id, params)
        request = Request(request_id, list(prompt_token_ids), params, self.max_total_tokens)
        request.output_token_ids = outputs
        if params.structured is not None:
            request.grammar = self.grammars.new_matcher(request_id, params.structured, outputs)
        if params.prompt_logprobs is not None and not outputs:
            request.prompt_logprobs = [TokenLogprob(prompt_token_ids[0])]  # nothing precedes token 0
        return request

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      output_token_ids: list[int]) -> None:
        """Raise ValueError (naming the request) for bad token ids, a logit_bias id outside the
        vocab, a schema the grammar library refuses, or output tokens that break the grammar.
        Takes nothing."""
        self.check_token_ids(request_id, prompt_token_ids, output_token_ids)
        self.check_logit_bias(request_id, params)
        if params.structured is not None:
            self.grammars.new_matcher(request_id, params.structured, output_token_ids)

    def check_logit_bias(self, request_id: str, params: SamplingParams) -> None:
        vocab = self.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"request {request_id}: logit_bias token ids {bad[:5]} are outside [0, {vocab})")

    def check_token_ids(self, request_id: str, prompt: list[int], outputs: list[int]) -> None:
        if not prompt:
            raise ValueError(f"request {request_id}: prompt must not be empty")
        limit = self.max_total_tokens
        if len(prompt) + len(outputs) >= limit:
            raise ValueError(
                f"request {request_id}: prompt has {len(prompt) + len(outputs)} tokens; the "
                f"limit is {limit - 1} (max_model_len {limit} leaves room for one output token)"
            )
        vocab = self.vocab_size
        bad = [t for t in (*prompt, *outputs) if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"request {request_id}: token ids {bad[:5]} are outside [0, {vocab})")
