"""Sampler: picks each request's next token from its logits row, per-request settings in one batch.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p
exactly. A seeded request's noise comes from a CPU generator seeded by (seed, output index), so
its tokens depend neither on the batch it runs in nor on the node that samples them (prefill
node for the first token, decode node after). Everything else is computed where the logits are
(on a GPU, unseeded noise is drawn there too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.grammar import mask_logits
from engine.protocol import TokenLogprob
from engine.request import Request

_SEED_STRIDE = 1_000_003


@dataclass
class _Rows:
    """Per-row sampling settings of one batch, as tensors."""

    temperature: torch.Tensor  # [num_rows, 1]
    top_k: torch.Tensor  # [num_rows], vocab size where off
    top_p: torch.Tensor  # [num_rows]
    min_p: torch.Tensor | None  # [num_rows]; None where no row has one (known on the host: no device sync)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], seed: int = 0,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # the backend's row argmax (Backend.argmax): torch.argmax's answer, ties and NaN alike
        self._argmax = argmax if argmax is not None else (lambda x: x.argmax(dim=-1))
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._seed = seed
        self._generators = {torch.device("cpu"): torch.Generator().manual_seed(seed)}  # unseeded rows' noise
        self._row_generator = torch.Generator()

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[TokenLogprob]:
        """logits: [num_requests, vocab] (any dtype); returns one token per request, in order.
        A request's logit_bias is added to its row and its grammar masks the row before any
        choice (greedy included)."""
        if logits.dtype != torch.float32 and not all(is_plain_greedy(r) for r in requests):
            logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, requests)
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_bias_and_grammars(logits, requests)
        logits = self._mask_early_stops(logits, requests)
        # NOTE: the argmax of every row where any is greedy (no row gather: a copy of the whole logits)
        greedy_tokens = self._argmax(logits) if any(r.params.is_greedy for r in requests) else None
        return _with_logprobs(self.draw(logits, greedy_tokens, requests), raw_logprobs, requests)

    def draw(self, logits: torch.Tensor, greedy_tokens: torch.Tensor | None,
             requests: list[Request]) -> torch.Tensor:
        """The requests' tokens, left on the logits' device (int64 [rows]) with no wait for it:
        greedy rows take greedy_tokens (the argmax of their logits; None where no row is greedy),
        the others a draw from their logits. sample()'s choice once it has edited the logits; an
        async step's (requests that sample on the device, samples_on_device) as they are."""
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if not random_rows:
            return greedy_tokens
        if len(random_rows) == len(requests):
            return self._sample_random(logits.float(), requests)
        rows = to_device(random_rows, torch.long, logits.device)
        drawn = self._sample_random(logits.index_select(0, rows).float(), [requests[i] for i in random_rows])
        return greedy_tokens.index_copy(0, rows, drawn)

    def tokens_of(self, token_ids: torch.Tensor, requests: list[Request]) -> list[TokenLogprob]:
        """sample's answer for plain greedy requests (is_plain_greedy) whose argmax is known."""
        return _with_logprobs(token_ids, None, requests)

    def _raw_logprobs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
        # NOTE: logprobs are those of the model's distribution (before temperature, penalties
        # and truncation), as OpenAI and vLLM report them.
        if all(r.params.logprobs is None for r in requests):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        picked = [requests[i] for i in rows]
        device = logits.device
        output_counts = self._token_counts([r.output_token_ids for r in picked], device)
        seen = self._token_counts([r.prompt_token_ids for r in picked], device) + output_counts > 0
        rep = torch.tensor([r.params.repetition_penalty for r in picked], device=device).unsqueeze(1)
        freq = torch.tensor([r.params.frequency_penalty for r in picked], device=device).unsqueeze(1)
        presence = torch.tensor([r.params.presence_penalty for r in picked], device=device).unsqueeze(1)
        sub = logits[rows]
        # Repetition penalty as in transformers: shrink positive logits, grow negative ones.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq * output_counts - presence * (output_counts > 0).float()
        logits[rows] = sub
        return logits

    def _apply_bias_and_grammars(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        has_bias = any(r.params.logit_bias for r in requests)
        has_grammar = any(r.grammar is not None for r in requests)
        if not (has_bias or has_grammar):
            return logits  # NOTE: the common case stays copy-free (the all-greedy argmax path too)
        logits = logits.clone()  # the model's logits are inference tensors: edit a copy
        if has_bias:
            _apply_logit_bias(logits, requests)
        if has_grammar:
            mask_logits(logits, [r.grammar for r in requests])
        return logits

    def _token_counts(self, token_lists: list[list[int]], device: torch.device) -> torch.Tensor:
        """[len(token_lists), vocab] float counts on device (the token ids go there, not a
        vocabulary-wide table); padded with an extra column that is dropped."""
        width = max((len(t) for t in token_lists), default=0)
        padded = torch.full((len(token_lists), max(width, 1)), self.vocab_size, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            if tokens:
                padded[row, : len(tokens)] = torch.tensor(tokens)
        padded = padded.to(device)
        counts = torch.zeros(len(token_lists), self.vocab_size + 1, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float))
        return counts[:, : self.vocab_size]

    def _mask_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """min_tokens: no stop token (eos or stop_token_ids) before that many outputs, unless
        nothing else is allowed (a complete grammar allows only eos: the grammar wins)."""
        rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return logits
        entry_rows, entry_ids, entry_of = [], [], []  # each (row, stop id), and its row's place in rows
        for place, i in enumerate(rows):
            params = requests[i].params
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids += list(self.eos_token_ids)
            stop_ids = [t for t in stop_ids if t < self.vocab_size]
            entry_rows += [i] * len(stop_ids)
            entry_ids += stop_ids
            entry_of += [place] * len(stop_ids)
        if not entry_rows:
            return logits
        # NOTE: whole batch at once (no sync a row): masked, then put back where a row has nothing left
        logits = logits.clone()
        device = logits.device
        at = (torch.tensor(entry_rows, device=device), torch.tensor(entry_ids, device=device))
        kept = logits[at]
        logits[at] = float("-inf")
        has_other = torch.isfinite(logits[torch.tensor(rows, device=device)]).any(dim=1)
        logits[at] = torch.where(has_other[torch.tensor(entry_of, device=device)], float("-inf"), kept)
        return logits

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = _row_settings(requests, self.vocab_size, logits.device)
        probs = torch.softmax(logits / rows.temperature, dim=-1)
        noise = self._exponential_noise(requests, logits.device)
        # NOTE: decided from the requests' own settings, not the device tensors (no sync)
        if any(0 < r.params.top_k < self.vocab_size or r.params.top_p < 1.0 for r in requests):
            return self._sample_truncated(probs, noise, rows)
        probs = _apply_min_p(probs, rows.min_p)
        return (probs / noise).argmax(dim=-1)

    def _sample_truncated(self, probs: torch.Tensor, noise: torch.Tensor, rows: _Rows) -> torch.Tensor:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        outside_k = rank >= rows.top_k.unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside_p = mass_before >= rows.top_p.unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(outside_k | outside_p, 0.0)
        sorted_probs = _apply_min_p(sorted_probs, rows.min_p)
        sorted_noise = noise.gather(1, sorted_ids)
        chosen_rank = (sorted_probs / sorted_noise).argmax(dim=-1, keepdim=True)
        return sorted_ids.gather(1, chosen_rank).squeeze(1)

    def _exponential_noise(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """[len(requests), vocab] Exp(1) draws on device: unseeded rows from the sampler's generator
        for that device, seeded rows from their own (on the CPU: the same draws on every node)."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        noise = torch.empty(len(requests), self.vocab_size, device=device)
        noise.exponential_(generator=generator)
        seeded = [row for row, request in enumerate(requests) if request.params.seed is not None]
        if seeded:
            rows = torch.empty(len(seeded), self.vocab_size)
            for i, row in enumerate(seeded):
                request = requests[row]
                seed = request.params.seed * _SEED_STRIDE + request.num_output_tokens
                self._row_generator.manual_seed(seed % (2**63))
                rows[i].exponential_(generator=self._row_generator)
            # one copy for all of them, queued behind the step (no wait: see to_device)
            noise.index_copy_(0, to_device(seeded, torch.long, device), to_device(rows, torch.float32, device))
        return noise


def samples_on_device(request: Request) -> bool:
    """Nothing edits or reports its logits (no logprobs, penalties, logit_bias, grammar or pending
    min_tokens): its token is the argmax, or a draw, from the model's logits where they are, so a
    step of these needs nothing from the host (async scheduling launches it unread, Sampler.draw)."""
    params = request.params
    return (params.logprobs is None and not params.has_penalties and not params.logit_bias
            and request.grammar is None and request.num_output_tokens >= params.min_tokens)


def is_plain_greedy(request: Request) -> bool:
    """Greedy and samples_on_device: its token is the argmax of the model's logits in their own
    dtype (exact: widening to float32 keeps their order), so a batch of these needs no float32 copy
    of the logits (64 x 49,152 bfloat16: ~0.8 ms of a 55 ms step)."""
    return request.params.is_greedy and samples_on_device(request)


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    """Add each request's logit_bias to its row, in place (ids were checked against the vocab)."""
    for row, request in enumerate(requests):
        bias = request.params.logit_bias
        if bias:
            token_ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[row, token_ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)


def _row_settings(requests: list[Request], vocab_size: int, device: torch.device) -> _Rows:
    return _Rows(
        temperature=to_device([r.params.temperature for r in requests], torch.float32, device).unsqueeze(1),
        top_k=to_device([r.params.top_k if 0 < r.params.top_k < vocab_size else vocab_size for r in requests],
                         torch.long, device),
        top_p=to_device([r.params.top_p for r in requests], torch.float32, device),
        min_p=(to_device([r.params.min_p for r in requests], torch.float32, device)
               if any(r.params.min_p > 0 for r in requests) else None),
    )


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values on device without waiting for the device: a GPU gets them from pinned memory,
    non-blocking (a plain torch.tensor(..., device=cuda) waits for the stream's queued work)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    if min_p is None:
        return probs
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _with_logprobs(
    token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, requests: list[Request]
) -> list[TokenLogprob]:
    ids = token_ids.tolist()
    if raw_logprobs is None:
        return [TokenLogprob(token_id) for token_id in ids]
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(r.params.logprobs or 0 for r in requests)
    top_values, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    if max_top:  # NOTE: to host memory once, not a device sync per row
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    results = []
    for row, request in enumerate(requests):
        num_top = request.params.logprobs
        if num_top is None:
            results.append(TokenLogprob(ids[row]))
            continue
        top = []
        if num_top:
            top = list(zip(top_ids[row][:num_top], top_values[row][:num_top]))
        results.append(TokenLogprob(ids[row], chosen[row], top))
    return results


def prompt_token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [len(token_ids), vocab]: row i is the position before token_ids[i]. Returns each
    token's log-softmax value with the top num_top (token_id, logprob) pairs of its row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if not num_top:
        return [TokenLogprob(t, value) for t, value in zip(token_ids, chosen)]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return [TokenLogprob(t, value, list(zip(ids, values)))
            for t, value, ids, values in zip(token_ids, chosen, top_ids.tolist(), top_values.tolist())]
