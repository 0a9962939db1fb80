"""Answering one completion request: check it, split it into choices, admit them (or refuse
with a 429), run them, and reply with the whole body or an SSE stream (a status code whenever
the failure comes before any token); and /tokenize and /detokenize, which share its prompt
handling."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.admission import Admission, Ticket
from proxy.chat_schemas import TokenizeChatRequest
from proxy.choice_run import ChoiceRun, ChoiceRunner
from proxy.choices import ChoiceDelta, ChoiceDone, ChoiceEvent, ChoiceFailed, ClientGone, SubRequest
from proxy.clients import client_id
from proxy.config import ProxyConfig
from proxy.errors import ApiError, api_error_of
from proxy.ledger import Outcome
from proxy.metrics import ProxyMetrics
from proxy.node_names import NodeNames
from proxy.nodes import NodePool
from proxy.openai_format import SSE_DONE, ResponseFormat
from proxy.schemas import DetokenizeRequest, GenerationRequest, TokenizeCompletionRequest
from proxy.tokenizer import ModelTokenizer
from proxy.uploads import BodyReader

logger = logging.getLogger(__name__)

_CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, but the metrics count it


class RequestService:
    """The endpoints' common work; one per app."""

    def __init__(self, config: ProxyConfig, tokenizer: ModelTokenizer, pool: NodePool, metrics: ProxyMetrics,
                 admission: Admission, names: NodeNames, reader: BodyReader) -> None:
        self.config = config
        self.reader = reader
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics
        self.admission = admission
        self.names = names
        self.ledger = metrics.ledger  # every generation request from its admission to its end
        self.runner = ChoiceRunner(pool, tokenizer, metrics, config.first_token_timeout_s, config.request_timeout_s)

    async def admit(self, endpoint: str, request: Request) -> tuple[bytes, Ticket]:
        """The request's whole body and its admission ticket (endpoint: the metrics label),
        taken once the body has arrived, so a stalled upload holds no slot; a request that would
        be refused now is refused before its body is read. Raises ApiError (the reader's 4xx, a
        429 (counted) when the proxy or the client is full, 503 while draining) or ClientGone."""
        client = client_id(request)
        try:
            self.admission.precheck(client)
            raw = await self.reader.read(request)
            return raw, self.admission.enter(client)
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise

    def max_model_len(self) -> int:
        """The longest sequence served: configured, else the nodes' shortest, else the model's."""
        return self.config.max_model_len or self.pool.max_model_len() or self.tokenizer.max_position_embeddings

    async def complete(self, body: GenerationRequest, fmt: ResponseFormat, request: Request,
                       ticket: Ticket) -> Response | dict:
        """The answer to body (a dict is sent as JSON); raises ApiError for an error answer.
        ticket (from admit(), taken once the body had arrived) grows to the request's
        choices and passes to them once they run; the caller releases it afterwards."""
        self.ledger.open(fmt.request_id)
        outcome: Outcome | None = Outcome.UNANSWERED
        try:
            response = await self._complete(body, fmt, request, ticket)
        except Exception:  # an ApiError, or a bug: both answered with an error body (proxy.errors)
            outcome = Outcome.ERROR
            raise
        except asyncio.CancelledError:
            outcome = Outcome.CLIENT_GONE  # uvicorn cancels a handler whose client went away
            raise
        else:
            if isinstance(response, StreamingResponse):
                outcome = None  # the stream ends it
            elif isinstance(response, Response) and response.status_code == _CLIENT_GONE:
                outcome = Outcome.CLIENT_GONE
            else:
                outcome = Outcome.TOKENS
            return response
        finally:
            if outcome is not None:
                self.ledger.end(fmt.request_id, outcome)

    async def _complete(self, body: GenerationRequest, fmt: ResponseFormat, request: Request,
                        ticket: Ticket) -> Response | dict:
        arrived_at = time.monotonic()
        try:
            self._check_model(body.model)
            ticket.resize(body.num_prompts * body.n)  # NOTE: before tokenizing: an overloaded proxy does no work
            subs = await self._sub_requests(body, fmt)
            self.admission.check([len(s.prompt.token_ids) for s in subs])
        except ApiError as exc:
            self._count(fmt, exc.status)
            logger.info("request %s refused: %d %s", fmt.request_id, exc.status, exc.message)
            raise
        logger.debug("request %s: %d choice(s), prompt tokens %s", fmt.request_id, len(subs),
                     sorted({len(s.prompt.token_ids) for s in subs}))
        run = self.runner.start(subs, body.text_options, arrived_at)
        ticket.attach(run.tasks[:len(subs)], run.states)
        if body.stream:
            return await self._start_stream(body, fmt, run, request)
        return await self._complete_all(fmt, run, request)

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """/tokenize's answer (vLLM's shape); raises ApiError."""
        if body.model is not None:
            self._check_model(body.model)
        ids = await asyncio.to_thread(body.prompt_ids, self.tokenizer)  # a chat template may take milliseconds
        pieces = await asyncio.to_thread(self.tokenizer.token_pieces, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len(), "tokens": ids, "token_strs": pieces}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """/detokenize's answer: the text, special tokens kept (transformers' decode); raises ApiError."""
        if body.model is not None:
            self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens")
        # NOTE: in a thread: a body may hold a million token ids (decoding them takes ~100 ms).
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens, False)}

    def _check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", "model", code="model_not_found")

    async def _sub_requests(self, body: GenerationRequest, fmt: ResponseFormat) -> list[SubRequest]:
        """One per choice: n per prompt, indexed prompt by prompt; raises ApiError (400)."""
        # NOTE: in a thread: a chat template over a long conversation, or a long text, takes
        # milliseconds (a template is stopped after chat_template_timeout_s).
        prompts = await asyncio.to_thread(body.prompts, self.tokenizer)
        self._check_token_ids(list(body.logit_bias_ids or ()), "logit_bias")
        self._check_token_ids(body.stop_token_ids, "stop_token_ids")
        subs = []
        for prompt_idx, prompt in enumerate(prompts):
            self._check_prompt(prompt.token_ids)
            max_tokens = self._max_tokens(body, len(prompt.token_ids))
            for i in range(body.n):
                index = prompt_idx * body.n + i
                sampling = body.sampling(max_tokens, seed_offset=i)
                subs.append(SubRequest(fmt.choice_request_id(index), index, prompt, sampling, body.structured_param))
        return subs

    def _max_tokens(self, body: GenerationRequest, num_prompt_tokens: int) -> int:
        """The limit asked for, refused (400, as vLLM) when past the context left after the
        prompt; unasked, the request kind's default, cut to the context left."""
        limit = self.max_model_len()
        num_left = limit - num_prompt_tokens
        asked = body.asked_max_tokens
        if asked is None:
            default = body.default_max_tokens
            return num_left if default is None else min(default, num_left)
        param, value = asked
        if value > num_left:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{value} output tokens and your prompt contains {num_prompt_tokens} input tokens, "
                                f"for a total of {value + num_prompt_tokens} tokens. Please reduce the length of "
                                f"the input prompt or the number of requested output tokens.", param,
                           code="context_length_exceeded")
        return value

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ApiError(400, "prompt is empty after tokenization", "prompt")
        limit = self.max_model_len()
        if len(ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(ids)} tokens (at least one output token must fit)", "prompt",
                           code="context_length_exceeded")
        self._check_token_ids(ids, "prompt")

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {self.tokenizer.vocab_size})",
                           param)

    async def _complete_all(self, fmt: ResponseFormat, run: ChoiceRun, request: Request) -> Response | dict:
        # NOTE: uvicorn does not cancel a non-streaming handler when its client goes away; this
        # watcher does, so the nodes hear Abort instead of generating for nobody.
        run.watch_disconnect(request)
        try:
            remaining = len(run.subs)
            while remaining:
                match await run.events.get():
                    case ClientGone():
                        self._count(fmt, _CLIENT_GONE)
                        return Response(status_code=_CLIENT_GONE)  # the finally aborts on the nodes
                    case ChoiceFailed(error=error):
                        raise self._failure(fmt, error)
                    case ChoiceDone():
                        remaining -= 1
                    case _:
                        pass  # a delta: the choice's state holds its text already
        except ApiError as exc:
            self._count(fmt, exc.status)
            raise
        finally:
            run.cancel()
        self._count(fmt, 200)
        return fmt.body(run.subs, run.states)

    async def _start_stream(self, body: GenerationRequest, fmt: ResponseFormat, run: ChoiceRun,
                            request: Request) -> Response:
        """Hold the response until the first event of any choice, so a request that fails before
        streaming began gets a real status code rather than an SSE error."""
        first = await self._first_event(run, request)
        if isinstance(first, ClientGone):
            self._count(fmt, _CLIENT_GONE)
            return Response(status_code=_CLIENT_GONE)
        if isinstance(first, ChoiceFailed):
            error = self._failure(fmt, first.error)
            self._count(fmt, error.status)
            raise error
        self._count(fmt, 200)
        events = self._stream_events(body, fmt, run, first, self._failure,
                                     lambda outcome: self.ledger.end(fmt.request_id, outcome))
        # NOTE: started here, so its finally (which cancels the choices) runs even if the response
        # never reads on: an unstarted generator is dropped without running its finally.
        opening = await anext(events)
        return StreamingResponse(_chain(opening, events), media_type="text/event-stream")

    @staticmethod
    async def _first_event(run: ChoiceRun, request: Request) -> ChoiceEvent:
        """The first event of any choice, or ClientGone; the run is cancelled unless a delta came."""
        watcher = run.watch_disconnect(request)
        try:
            first = await run.events.get()
        except BaseException:
            run.cancel()
            raise
        finally:
            watcher.cancel()
        if not isinstance(first, (ChoiceDelta, ChoiceDone)):
            run.cancel()
        return first

    @staticmethod
    async def _stream_events(body: GenerationRequest, fmt: ResponseFormat, run: ChoiceRun, first: ChoiceEvent,
                             failure: Callable[[ResponseFormat, Exception], ApiError],
                             ended: Callable[[Outcome], None]) -> AsyncIterator[str]:
        """The SSE events of all choices from first on; a failure ends the stream with an error
        event. Cancels the run when done or closed (the client left); tells ended how it ended."""
        outcome = Outcome.CLIENT_GONE  # closed before its end: the client left
        try:
            yield fmt.opening_events(run.subs, run.states)
            remaining, event, ready = len(run.subs), first, []
            while True:
                match event:
                    case ChoiceDelta(index=index, delta=delta):
                        chunk = fmt.delta_event(run.states[index], delta)
                        if chunk:
                            ready.append(chunk)
                    case ChoiceDone():
                        remaining -= 1
                    case ChoiceFailed(error=error):
                        ready.append(fmt.error_event(failure(fmt, error)))
                        outcome = Outcome.ERROR
                        break
                    case ClientGone():
                        return
                if not remaining:
                    break
                if run.events.empty():
                    if ready:
                        # NOTE: the events that came meanwhile go out in one write: a proxy behind
                        # its nodes catches up instead of paying a send per token
                        # (benchmarks/proxy_capacity.py).
                        yield "".join(ready)
                        ready.clear()
                    event = await run.events.get()
                else:
                    event = run.events.get_nowait()
            if body.include_usage:
                ready.append(fmt.usage_event(run.subs, run.states))
            ready.append(SSE_DONE)
            yield "".join(ready)
            if outcome is not Outcome.ERROR:
                outcome = Outcome.TOKENS
        except Exception:
            if outcome is Outcome.CLIENT_GONE:
                outcome = Outcome.UNANSWERED
            raise
        finally:
            ended(outcome)
            run.cancel()  # done or client gone: run_request's finally aborts on the nodes

    def _count(self, fmt: ResponseFormat, status: int) -> None:
        self.metrics.requests.labels(fmt.endpoint, str(status)).inc()

    def _failure(self, fmt: ResponseFormat, error: Exception) -> ApiError:
        """The answer to a failed choice, logged under the request's id (with node addresses; the
        client sees node names, see NodeNames)."""
        answer = api_error_of(error, fmt.request_id)
        logger.log(logging.WARNING if answer.status >= 500 else logging.INFO, "request %s failed: %d %s",
                   fmt.request_id, answer.status, answer.message)
        answer.message = self.names.redact(answer.message)
        return answer


async def _chain(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()  # NOTE: completes without suspending: rest's finally only cancels tasks
