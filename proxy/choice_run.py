"""Running all choices of one request at once through the nodes, their events merged into one
queue of ChoiceEvents, with latency metrics and cancellation (which aborts on the nodes)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request

from proxy.choices import ChoiceDelta, ChoiceDone, ChoiceEvent, ChoiceFailed, ChoiceState, ClientGone, SubRequest
from proxy.errors import ApiError, NodeRejected
from proxy.metrics import ProxyMetrics
from proxy.nodes import NodePool
from proxy.request_flow import run_request
from proxy.tokenizer import ModelTokenizer, TextOptions


@dataclass
class ChoiceRun:
    """The running choices of one request: per choice a ChoiceState, and for each a stream of
    ChoiceDelta events ending in ChoiceDone or ChoiceFailed, all in events."""

    subs: list[SubRequest]
    states: dict[int, ChoiceState]
    events: asyncio.Queue[ChoiceEvent]
    tasks: list[asyncio.Task]

    def watch_disconnect(self, request: Request) -> asyncio.Task:
        """Put ClientGone on events when the client disconnects; the task ends with cancel()."""
        task = asyncio.create_task(_report_disconnect(request, self.events))
        self.tasks.append(task)
        return task

    def cancel(self) -> None:
        """Stop every choice (each request flow aborts on its nodes) and watcher; never blocks."""
        for task in self.tasks:
            task.cancel()


class ChoiceRunner:
    """Starts ChoiceRuns on a node pool; records TTFT, inter-token and end-to-end latency, token
    counts and aborts."""

    def __init__(self, pool: NodePool, tokenizer: ModelTokenizer, metrics: ProxyMetrics,
                 first_token_timeout_s: float, token_timeout_s: float) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s

    def start(self, subs: list[SubRequest], text: TextOptions, arrived_at: float) -> ChoiceRun:
        """Start every choice now; arrived_at (time.monotonic()) is when the request came in."""
        states = {s.index: ChoiceState(s.index, self.tokenizer, text, s.sampling.logprobs is not None) for s in subs}
        events: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(s, states[s.index], events, arrived_at)) for s in subs]
        return ChoiceRun(subs, states, events, tasks)

    async def _run_choice(self, sub: SubRequest, state: ChoiceState, events: asyncio.Queue[ChoiceEvent],
                          arrived_at: float) -> None:
        """Put the choice's deltas on events, then ChoiceDone; or ChoiceFailed."""
        last_at = None
        try:
            stream = run_request(self.pool, sub.request_id, sub.prompt.token_ids, sub.sampling,
                                 self.first_token_timeout_s, self.token_timeout_s)
            async for step in stream:
                if last_at is None:
                    state.prompt_logprobs = _prompt_logprobs(sub, step.prompt_logprobs)
                last_at = self._observe_token(arrived_at, last_at)
                if step.kv is not None:
                    state.kv_path = step.kv.label
                delta = state.add(step.tokens, step.finish_reason)
                await events.put(ChoiceDelta(sub.index, delta))
                if delta.finish_reason is not None:
                    await stream.aclose()  # a stop string: the finally of run_request aborts
                    break
            self.metrics.e2e.observe(time.monotonic() - arrived_at)
            self.metrics.generation_tokens.inc(state.num_tokens)
            self.metrics.prompt_tokens.inc(len(sub.prompt.token_ids))
            await events.put(ChoiceDone(sub.index))
        except asyncio.CancelledError:
            self.metrics.aborts.labels("disconnect").inc()
            raise
        except Exception as exc:  # noqa: BLE001 - answered to the client by the consumer
            self.metrics.aborts.labels(type(exc).__name__).inc()
            await events.put(ChoiceFailed(sub.index, _blamed(sub, exc)))

    def _observe_token(self, arrived_at: float, last_at: float | None) -> float:
        """Record the first token's latency or the gap since the last; returns now."""
        now = time.monotonic()
        if last_at is None:
            self.metrics.ttft.observe(now - arrived_at)
        else:
            self.metrics.itl.observe(now - last_at)
        return now


def _prompt_logprobs(sub: SubRequest, entries: list | None) -> list | None:
    """The first step's prompt logprobs; raises RuntimeError (a 500: a broken node) when asked
    for and missing or of the wrong length."""
    if sub.sampling.prompt_logprobs is None:
        return None
    if entries is None or len(entries) != len(sub.prompt.token_ids):
        raise RuntimeError(f"request {sub.request_id}: the node sent {0 if entries is None else len(entries)} "
                           f"prompt logprobs for {len(sub.prompt.token_ids)} prompt tokens")
    return entries


def _blamed(sub: SubRequest, exc: Exception) -> Exception:
    """A node's refusal of a structured request as a 400 naming the field that asked for the
    grammar: the proxy checks every other value a node checks (token ids, lengths, ranges,
    logit_bias ids) before sending, so what is left to refuse is the grammar (a schema the
    grammar library does not support)."""
    if isinstance(exc, NodeRejected) and exc.reply.is_client_error and sub.sampling.structured is not None:
        return ApiError(400, exc.reply.message, sub.structured_param)
    return exc


async def _report_disconnect(request: Request, events: asyncio.Queue[ChoiceEvent]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    await events.put(ClientGone())
