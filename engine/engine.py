"""LLMEngine: requests in, one scheduled and sampled step at a time, token deltas out.

Not thread-safe: one caller drives add_request/abort/step (a node's loop or the offline LLM).
A step that raises fails only the requests it belongs to (see LLMEngine.step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from engine.async_decodes import AsyncDecodes, InFlight
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs, capture_sizes
from engine.errors import EngineBroken, device_failure, ends_the_engine
from engine.grammar import Grammars
from engine.host_memory import keep_freed_memory
from engine.mixed_graphs import MixedGraphs, mixed_sizes
from engine.protocol import Role, TokenLogprob, num_blocks_for
from engine.request import FinishReason, Request
from engine.request_checks import RequestChecks
from engine.runner import ModelRunner, PromptSpan, StepLogits
from engine.sampler import Sampler, prompt_token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import PrefixCacheStats, Scheduler, SchedulerOutput
from engine.tp_ranks import TPRanks, build_rank
from engine.tp_shard import tp_shard
from kernels.select import select_backend

logger = logging.getLogger(__name__)


class PrefillRate:
    """This engine's prefill throughput in tokens/s, for routing: a moving average over steps
    with at least min_tokens prefill tokens. A step's whole time is charged to its prefill
    tokens, so an engine busy decoding too looks slower at prefill, as it is."""

    def __init__(self, min_tokens: int = 64, weight: float = 0.3) -> None:
        self.min_tokens = min_tokens
        self.weight = weight
        self.tokens_per_s = 0.0  # 0: not measured yet

    def observe(self, num_prefill_tokens: int, elapsed_s: float) -> None:
        if num_prefill_tokens < self.min_tokens or elapsed_s <= 0:
            return
        rate = num_prefill_tokens / elapsed_s
        if self.tokens_per_s == 0.0:
            self.tokens_per_s = rate
        else:
            self.tokens_per_s += self.weight * (rate - self.tokens_per_s)


@dataclass(frozen=True)
class PromptProgress:
    """LLMEngine.prompt_progress's answer."""

    final_block_ids: list[int]
    num_preemptions: int


@dataclass
class StepOutput:
    """New tokens of one request from one step. block_ids is set only for a PREFILLED finish:
    the caller then owns those blocks and must pass them to LLMEngine.free_blocks.
    prompt_logprobs is set once, with a request's first token, when it asked for them and was
    prefilled here arriving with no output tokens (see protocol.PrefillResult for the layout).
    first_token_idx: the index of new_tokens[0] among the request's output tokens. An ERROR
    finish has no tokens and error says what failed (the engine has freed the request)."""

    request_id: str
    new_tokens: list[TokenLogprob]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    first_token_idx: int = 0
    error: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        if config.device == "cpu":
            keep_freed_memory()  # before the cache and weights exist, so they come from the heap too
        model_cfg = config.model
        # Triton launches on the thread's current device, whatever its tensors' (cuda:N): set here for
        # the build and the capture, and at every step (the thread stepping may be another). Plain
        # "cuda" is the current device, left as the caller set it.
        self._cuda_index = torch.device(config.device).index if config.device.startswith("cuda") else None
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)
        self.backend = select_backend(config.device, config.kernel_backend)
        # A prefill-only engine runs big batches: no copies of the projections for small ones (build_rank).
        self.ranks: TPRanks | None = None
        if config.tensor_parallel_size > 1:
            self.ranks, built = TPRanks.start(config, self.backend)
        else:
            built = build_rank(config, self.backend, None)
        num_blocks = built.num_blocks
        self.config = replace(config, cache=replace(config.cache, num_blocks=num_blocks))
        self.block_size = config.cache.block_size
        self.model = built.model
        self.kv_cache = built.kv_cache
        self.block_pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.block_pool, self.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size, config.device,
                                  self._decode_graphs(self.config), self.ranks, self._mixed_graphs(self.config))
        self.sampler = Sampler(model_cfg.vocab_size, model_cfg.eos_token_ids, config.seed, self.backend.argmax)
        self.grammars = Grammars(model_cfg.model_dir, model_cfg.vocab_size, model_cfg.eos_token_ids)
        # A lone request must always fit, or it would preempt itself forever.
        self.max_total_tokens = min(model_cfg.max_model_len, num_blocks * self.block_size)
        self.checks = RequestChecks(model_cfg, self.max_total_tokens, self.grammars)
        # NOTE: a split model's workers do not hold the sampled tokens an async launch feeds on the device.
        self.async_decodes = AsyncDecodes(self.runner.graphs, self.scheduler, self.sampler,
                                          config.async_scheduling and self.ranks is None)
        self._requests: dict[str, Request] = {}
        self._in_flight: InFlight | None = None
        self.num_steps = 0
        self.prefill_rate = PrefillRate()
        logger.info("engine ready: %s, %d blocks of %d tokens", model_cfg.name, num_blocks, self.block_size)

    @staticmethod
    def _static_steps(config: EngineConfig) -> bool:
        """Whether steps run on static buffers (decode and mixed graphs): decode_graphs static, or
        auto on CUDA (captured there)."""
        mode = config.decode_graphs
        return mode == "static" or (mode == "auto" and torch.device(config.device).type == "cuda")

    def _decode_graphs(self, config: EngineConfig) -> DecodeGraphs | None:
        """The static decode path (engine.decode_graphs) this configuration asks for, captured."""
        if config.role is Role.PREFILL or not self._static_steps(config):
            return None
        capture = config.decode_graphs == "auto"
        if capture and not self.backend.graph_capturable:
            logger.info("decode graphs: the %s backend's steps cannot be captured; static buffers, run eagerly",
                        self.backend.name)
            capture = False
        graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, config.model.max_model_len,
                              capture_sizes(config.scheduler.max_num_seqs), capture=capture, ranks=self.ranks)
        report = graphs.capture()
        if graphs.use_graphs:
            logger.info("decode graphs: %d batch sizes (%s) captured in %.1f s, %.0f MiB of device memory",
                        len(report.sizes), ", ".join(map(str, report.sizes)), report.seconds,
                        report.memory_bytes / (1 << 20))
        return graphs

    def _mixed_graphs(self, config: EngineConfig) -> MixedGraphs | None:
        """The steps with prompt tokens as graph pieces (engine.mixed_graphs) this configuration asks
        for, captured; None where it asks for none, and for a split model."""
        sizes = mixed_sizes(min(config.mixed_graph_tokens, config.scheduler.max_num_batched_tokens))
        if not sizes or not self._static_steps(config):
            return None
        capture = config.decode_graphs == "auto"
        if self.ranks is not None:
            logger.info("mixed graphs: none for a split model (its collectives cut its steps); steps with prompt "
                        "tokens run eagerly")
            return None
        if capture and not self.backend.graph_capturable:
            logger.info("mixed graphs: the %s backend's steps cannot be captured; steps with prompt tokens run "
                        "eagerly", self.backend.name)
            return None
        mixed = MixedGraphs(self.model, self.kv_cache, sizes, capture=capture)
        try:
            report = mixed.capture()
        except Exception as exc:  # noqa: BLE001 - the node serves without them, eagerly, rather than not at all
            if device_failure(exc):
                raise
            logger.warning("mixed graphs: capture failed (%s: %s); steps with prompt tokens run eagerly",
                           type(exc).__name__, exc)
            return None
        if mixed.use_graphs:
            logger.info("mixed graphs: steps of up to %d tokens (%s) captured in %.1f s, %.0f MiB of device memory",
                        report.sizes[-1], ", ".join(map(str, report.sizes)), report.seconds,
                        report.memory_bytes / (1 << 20))
        return mixed

    def kv_cache_shards(self) -> list[tuple[torch.Tensor, range]]:
        """Every rank's KV cache (rank 0's own first) with the model's KV heads it holds: what a KV
        connector moves blocks of (block ids mean the same block on every rank). Raises
        ValueError where this engine does not hold the worker ranks' caches (tp_ranks.shares_caches)."""
        if self.ranks is None:
            return [(self.kv_cache, range(self.config.model.num_kv_heads))]
        if not self.ranks.worker_caches:
            raise ValueError("this split model's worker caches are not held by rank 0 (only prefill and decode "
                             "engines hold them)")
        own = tp_shard(self.config.model, 0, self.config.tensor_parallel_size).kv_heads
        return [(self.kv_cache, own), *self.ranks.worker_caches]

    def close(self) -> None:
        """Stop this engine's other tensor-parallel ranks (bounded); it runs no step after. A no-op
        for a one-rank engine, and safe to call twice."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request to be prefilled here. output_token_ids continues a request whose
        first tokens were sampled elsewhere (recomputed here with the prompt; its grammar, if
        any, accepts them first; no prompt logprobs are computed for it: they were sent where
        the first token was). Raises ValueError naming the request and the parameter for bad
        input; the engine keeps serving."""
        request = self._new_request(request_id, prompt_token_ids, params, output_token_ids)
        self._requests[request_id] = request
        self.scheduler.add_waiting(request)

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        first_token: TokenLogprob, block_ids: list[int], num_computed_tokens: int | None = None,
    ) -> None:
        """Join a request whose prompt KV already sits in block_ids (decode role, after a
        pull, or a prefix found cached here): their first num_computed_tokens tokens (default:
        the whole prompt); the rest is computed with the first token's step. The engine owns
        block_ids from here on (one reference each) and frees them when it finishes; their full
        blocks are cached. Raises ValueError as add_request (block_ids then stay the caller's)."""
        request = self._new_request(request_id, prompt_token_ids, params, [first_token.token_id])
        num_computed = len(prompt_token_ids) if num_computed_tokens is None else num_computed_tokens
        if not 0 <= num_computed <= len(prompt_token_ids):
            raise ValueError(f"request {request_id}: {num_computed} computed tokens of a "
                             f"{len(prompt_token_ids)}-token prompt")
        needed = num_blocks_for(num_computed, self.block_size)
        if len(block_ids) != needed:
            raise ValueError(f"request {request_id}: {len(block_ids)} blocks for {num_computed} tokens, "
                             f"which need {needed}")
        request.block_ids = list(block_ids)
        request.num_computed_tokens = num_computed
        self._requests[request_id] = request
        self.scheduler.cache_full_blocks(request)
        self.scheduler.add_running(request)

    def acquire_cached_prefix(self, request_id: str, token_ids: list[int], max_blocks: int) -> list[int]:
        """The cached blocks of token_ids' longest cached prefix of whole blocks (at most
        max_blocks), with a reference taken to each: the caller frees them (free_blocks) or
        hands them to add_prefilled_request. [] when prefix caching is off. Counts nothing
        (see count_prefix_lookup)."""
        probe = Request(request_id, list(token_ids), SamplingParams(), self.max_total_tokens)
        self.scheduler.acquire_cached_prefix(probe, min(max_blocks, len(token_ids) // self.block_size))
        return probe.block_ids

    def count_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup made outside the scheduler (a decode node's, for its pull)."""
        if self.config.enable_prefix_caching:
            self.scheduler.prefix_stats.count_lookup(num_query_tokens, num_hit_tokens)

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.scheduler.prefix_stats

    def forget_prefixes(self) -> None:
        """Drop every cached prefix block (they stay free) and the prefix-cache counts."""
        self.block_pool.reset_cache()
        self.scheduler.prefix_stats = PrefixCacheStats()

    def prefix_cache_keys(self, limit: int) -> tuple[int, list[int]]:
        """(version, keys of the cached blocks, most recently used first, at most limit): what
        the node reports for cache-aware routing. version grows when the set changes."""
        return self.block_pool.cache_version, self.block_pool.cached_hashes(limit)

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point and free its blocks; False if it is not here."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return blocks the caller owns (a PREFILLED request's, or ones it allocated)."""
        self.block_pool.free(block_ids)

    def prompt_progress(self, request_id: str) -> PromptProgress | None:
        """Where an unfinished request's prompt stands: its blocks, in order, whose KV no later
        step writes (the full blocks of its computed prompt tokens), and how often it was
        preempted (each preemption frees its blocks: those named before may since hold another
        request's KV). None if the request is not here. The blocks stay the engine's."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        num_final = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        return PromptProgress(request.block_ids[:num_final], request.num_preemptions)

    def wait_for_kv_writes(self) -> None:
        """Return once the KV writes of every step run so far are in memory (a GPU's run after the
        step returned), so another process may read those blocks. A no-op on the CPU. A split
        model's workers included: every step ends with a collective after its last KV write, even
        one that samples nothing (engine.tp_group.TPGroup._meet), which rank 0's device waits for."""
        if self.config.device.startswith("cuda"):
            torch.cuda.synchronize(self.config.device)

    def step(self) -> list[StepOutput]:
        """Schedule, run and sample one step; returns the requests that got tokens or ended.

        Failure isolation: when running the batch raises, each of its requests is run again
        alone; those whose own run raises end with FinishReason.ERROR (blocks freed, error
        set), the others go on exactly as if the batch had succeeded. This holds because a
        step changes no request before it has sampled (_run_batch commits last) and writes only
        the KV of its scheduled tokens, at the requests' own slots, which the retry writes
        again with the same values. Costs one extra forward per request, on failure only.
        Raises only when scheduling itself fails (a bug: the caller fails everything), or with
        EngineBroken when a rank of a tensor-parallel engine failed or the device did (a CUDA
        error: no request would run again): the engine can run no more steps (the caller fails
        everything and ends it).

        Async scheduling (EngineConfig.async_scheduling, with the static decode path): a pure
        decode step of requests that sample on the device (greedy or drawn: no logprobs, penalties,
        logit_bias, grammar or pending min_tokens) is launched without waiting for it; while it runs
        and its requests (and any that joined the running since with only their next token to
        compute) can only decode again, the next step is launched on its pending tokens before
        they are read. Each call still returns one step's tokens. A request that
        stops (a stop token or eos) is then known one step late: its extra step's token is dropped
        and its blocks are freed at once (the GPU's late write to them is ordered before any later
        step's; a writer outside the steps calls wait_for_late_writes first). Length limits are
        known ahead and never overrun."""
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)
        try:
            return self._step()
        except EngineBroken:
            raise
        except Exception as exc:
            if device_failure(exc):
                raise EngineBroken(f"the device failed ({type(exc).__name__}: {exc})") from exc
            raise

    def _step(self) -> list[StepOutput]:
        if self._in_flight is not None:
            return self._continue_and_read()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        self.num_steps += 1
        if self.async_decodes.takes(scheduled):
            try:
                self._in_flight = self.async_decodes.launch(scheduled.decodes, None)
            except Exception as exc:  # noqa: BLE001 - run it the synchronous way, with its isolation
                logger.warning("launching step %d failed (%s: %s); running it synchronously", self.num_steps,
                               type(exc).__name__, exc)
            else:
                return self._continue_and_read()
        try:
            return self._run_batch(scheduled)
        except Exception as exc:  # noqa: BLE001 - isolate the request(s) at fault, keep the rest
            if ends_the_engine(exc):
                raise  # the ranks or the device are broken: nothing is isolated, the engine is done
            logger.warning("step %d of %d requests failed (%s: %s); retrying them one by one", self.num_steps,
                           len(scheduled.decodes) + len(scheduled.prefills), type(exc).__name__, exc)
            return self._run_one_by_one(scheduled)

    def _continue_and_read(self) -> list[StepOutput]:
        """Launch the step after the one in flight where its requests, and any that joined the
        running since with only their next token to compute, can only decode again; then read
        the one in flight (its tokens, finishes)."""
        current = self._in_flight
        live = [r for r in current.decodes if not r.is_finished]
        self._in_flight = None
        decodes = self.async_decodes.decodes_again(live) if live else None
        if decodes:
            try:
                self._in_flight = self.async_decodes.launch(decodes, current)
                self.num_steps += 1
            except Exception as exc:  # noqa: BLE001 - the next call schedules it the synchronous way
                logger.warning("launching step %d failed (%s: %s)", self.num_steps + 1, type(exc).__name__, exc)
        return self._read(current)

    def _read(self, step: InFlight) -> list[StepOutput]:
        tokens = step.pending.tokens()
        outputs = []
        for request, index, token_id in zip(step.decodes, step.indices, tokens):
            if request.is_finished:
                continue  # aborted, or it stopped in the step before: this token is past its end
            request.output_token_ids[index] = token_id
            self.scheduler.cache_full_blocks(request)
            outputs.append(self._append_or_fail(request, TokenLogprob(token_id), index))
        return outputs

    def _run_batch(self, scheduled: SchedulerOutput) -> list[StepOutput]:
        """Run, gather and sample; only then commit (progress, prompt logprobs, tokens)."""
        started = time.perf_counter()
        step_logits = self.runner.execute(scheduled)
        if self.kv_cache.is_cuda and scheduled.num_prefill_tokens >= self.prefill_rate.min_tokens:
            # NOTE: on a GPU execute() returns once the work is queued: the rate is of the work done.
            torch.cuda.synchronize(self.kv_cache.device)
        elapsed = time.perf_counter() - started
        self.prefill_rate.observe(scheduled.num_prefill_tokens, elapsed)
        prompt_logprobs = [(span, _prompt_logprobs_of(span)) for span in step_logits.prompt_spans]
        sampled_requests = step_logits.sampled_requests
        tokens = self._sample(step_logits)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %d decodes, %d prefill tokens in %d chunks, %d free blocks, %.1f ms",
                         self.num_steps, len(scheduled.decodes), scheduled.num_prefill_tokens,
                         len(scheduled.prefills), self.num_free_blocks, 1000 * elapsed)
        # NOTE: nothing above changed a request; from here on nothing raises but a bug.
        for request, num_new in scheduled.scheduled():
            request.num_computed_tokens += num_new
            self.scheduler.cache_full_blocks(request)
        for span, logprobs in prompt_logprobs:
            span.request.prompt_logprobs.extend(logprobs)
        return [self._append_or_fail(r, t) for r, t in zip(sampled_requests, tokens)]

    def _sample(self, step_logits: StepLogits) -> list[TokenLogprob]:
        """Each sampled request's token, in order: from its logits, or from the greedy head."""
        logits_requests = step_logits.logits_requests
        tokens = self.sampler.sample(step_logits.logits, logits_requests) if logits_requests else []
        if not step_logits.greedy_rows:
            return tokens
        sampled = step_logits.sampled_requests
        greedy = self.sampler.tokens_of(step_logits.greedy_tokens, [sampled[i] for i in step_logits.greedy_rows])
        merged = list(tokens)
        for i, token in zip(step_logits.greedy_rows, greedy):  # ascending: each goes back to its place
            merged.insert(i, token)
        return merged

    def _run_one_by_one(self, scheduled: SchedulerOutput) -> list[StepOutput]:
        decode_ids = {id(r) for r in scheduled.decodes}
        outputs = []
        for request, num_new in scheduled.scheduled():
            alone = (SchedulerOutput(decodes=[request]) if id(request) in decode_ids
                     else SchedulerOutput(prefills=[(request, num_new)]))
            try:
                outputs += self._run_batch(alone)
            except Exception as exc:  # noqa: BLE001 - this request's own failure: end it alone
                if ends_the_engine(exc):
                    raise
                outputs.append(self._fail(request, exc))
        return outputs

    def _fail(self, request: Request, exc: Exception) -> StepOutput:
        """End a request whose step raised: its blocks are freed; the output carries the error."""
        logger.warning("request %s failed in step %d: %s: %s", request.request_id, self.num_steps,
                       type(exc).__name__, exc)
        self._requests.pop(request.request_id, None)
        self._finish(request, FinishReason.ERROR)
        return StepOutput(request.request_id, [], FinishReason.ERROR, request.num_prompt_tokens,
                          first_token_idx=request.num_output_tokens, error=f"{type(exc).__name__}: {exc}")

    def _append_or_fail(self, request: Request, token: TokenLogprob, index: int | None = None) -> StepOutput:
        try:
            return self._append_token(request, token, index)
        except Exception as exc:  # noqa: BLE001 - a bug in one request's bookkeeping ends it alone
            return self._fail(request, exc)

    def _append_token(self, request: Request, token: TokenLogprob, index: int | None = None) -> StepOutput:
        """Take the request's next output token: appended, or (async scheduling) already in
        output_token_ids at index, with perhaps the next step's PENDING_TOKEN after it."""
        if index is None:
            index = request.num_output_tokens
            request.output_token_ids.append(token.token_id)
        output = StepOutput(request.request_id, [token], num_prompt_tokens=request.num_prompt_tokens,
                            first_token_idx=index)
        if request.needs_prompt_logprobs:
            assert len(request.prompt_logprobs) == request.num_prompt_tokens, (
                f"request {request.request_id}: {len(request.prompt_logprobs)} prompt logprobs for "
                f"{request.num_prompt_tokens} prompt tokens")
            output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if request.grammar is not None:
            # NOTE: the sampler masked this row with the grammar, so the token is always allowed.
            is_accepted = request.grammar.accept(token.token_id)
            assert is_accepted, f"request {request.request_id}: sampled token {token.token_id} breaks its grammar"
        reason = self._finish_reason(request, token.token_id, index + 1)
        if reason is not None:
            del request.output_token_ids[index + 1:]  # a step launched past the end: its token is dropped
            self._requests.pop(request.request_id, None)
            self._finish(request, reason)
            output.finish_reason = reason
            if reason is FinishReason.PREFILLED:
                output.block_ids = request.block_ids
        return output

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.grammar = None  # the matcher goes with the last reference to it
        request.prompt_logprobs = None
        in_flight = self._in_flight
        if in_flight is not None and any(r is request for r in in_flight.decodes):
            in_flight.late_blocks.update(request.block_ids)  # see wait_for_late_writes
        self.scheduler.finish(request, reason)

    def wait_for_late_writes(self, block_ids: list[int]) -> None:
        """Call before anything that is not one of this engine's steps writes block_ids (a NIXL
        read into them: its copies are not ordered with the steps'). A request that ended while a
        launched step still computes its next token gave its blocks back at once; that step
        writes one KV slot in them: if it is still in flight and wrote to one of block_ids, wait
        for it."""
        in_flight = self._in_flight
        if in_flight is not None and in_flight.late_blocks and not in_flight.late_blocks.isdisjoint(block_ids):
            in_flight.pending.wait()
            in_flight.late_blocks.clear()

    def _finish_reason(self, request: Request, token_id: int, num_outputs: int) -> FinishReason | None:
        """Why the request ends with token_id, its num_outputs-th output token; None: it goes on."""
        params = request.params
        if request.grammar is not None and request.grammar.is_terminated:
            return FinishReason.STOP  # the grammar is complete and took its eos (even with ignore_eos)
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if token_id in self.config.model.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if num_outputs >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_prompt_tokens + num_outputs >= request.max_total_tokens:
            return FinishReason.LENGTH
        if self.config.role is Role.PREFILL:
            return FinishReason.PREFILLED
        return None

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        output_token_ids: list[int] | None,
    ) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.checks.new_request(request_id, prompt_token_ids, params, output_token_ids)

    def check_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, output_token_ids: list[int],
    ) -> None:
        """Raise ValueError (naming the request) for anything add_request would refuse
        (request_checks.RequestChecks.check_request). Takes nothing; for a node to check before
        it spends blocks or a transfer on the request."""
        self.checks.check_request(request_id, prompt_token_ids, params, output_token_ids)

    def check_token_ids(self, request_id: str, prompt: list[int], outputs: list[int]) -> None:
        self.checks.check_token_ids(request_id, prompt, outputs)

    def check_leaks(self) -> None:
        """Assert that an idle engine holds no blocks (tests and shutdown call it)."""
        assert not self.has_unfinished(), f"{self.num_unfinished} requests left"
        assert self.grammars.num_live_matchers == 0, f"{self.grammars.num_live_matchers} grammar matchers left"
        assert self.num_free_blocks == self.block_pool.num_blocks, (
            f"{self.block_pool.num_blocks - self.num_free_blocks} blocks still allocated"
        )
        self.block_pool.check_consistent()


def _prompt_logprobs_of(span: PromptSpan) -> list[TokenLogprob]:
    """The logprobs of prompt tokens first_idx + 1 onward (from the span's logits), which the
    request appends once the step succeeded."""
    request = span.request
    first = span.first_idx + 1
    assert len(request.prompt_logprobs) == first, (
        f"request {request.request_id}: prompt logprobs {len(request.prompt_logprobs)} gathered, next is {first}")
    targets = request.prompt_token_ids[first : first + span.num_positions]
    return prompt_token_logprobs(span.logits, targets, request.params.prompt_logprobs)
