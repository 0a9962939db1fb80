"""proxy.service.RequestService._stream_events: the SSE events a stream sends, and in how many
writes: events already queued when the stream is sent go out in one write."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from proxy.choice_run import ChoiceRun
from proxy.choices import ChoiceDelta, ChoiceDone
from proxy.ledger import Outcome
from proxy.openai_format import SSE_DONE
from proxy.service import RequestService


class _Format:
    """Renders a delta as its own SSE event (the real formats render JSON; the writes are the point)."""

    def opening_events(self, subs, states) -> str:
        return ""

    def delta_event(self, state, delta) -> str:
        return f"data: {delta}\n\n"

    def usage_event(self, subs, states) -> str:
        return "data: usage\n\n"


def _writes(queued: list, first, include_usage: bool = False) -> tuple[list[str], list[Outcome]]:
    async def main():
        events: asyncio.Queue = asyncio.Queue()
        run = ChoiceRun([SimpleNamespace(index=0)], {0: None}, events, [])
        for event in queued:
            events.put_nowait(event)
        ended: list[Outcome] = []
        body = SimpleNamespace(include_usage=include_usage)
        writes = [w async for w in RequestService._stream_events(body, _Format(), run, first, None, ended.append)]
        return writes, ended

    return asyncio.run(main())


def test_events_already_queued_go_out_in_one_write_with_the_end():
    queued = [ChoiceDelta(0, f"t{i}") for i in range(1, 5)] + [ChoiceDone(0)]
    writes, ended = _writes(queued, ChoiceDelta(0, "t0"), include_usage=True)
    assert writes == ["", "".join(f"data: t{i}\n\n" for i in range(5)) + "data: usage\n\n" + SSE_DONE]
    assert ended == [Outcome.TOKENS]


def test_events_that_come_one_by_one_go_out_one_by_one():
    async def main():
        events: asyncio.Queue = asyncio.Queue()
        run = ChoiceRun([SimpleNamespace(index=0)], {0: None}, events, [])
        stream = RequestService._stream_events(SimpleNamespace(include_usage=False), _Format(), run,
                                               ChoiceDelta(0, "t0"), None, lambda outcome: None)
        writes = [await anext(stream), await anext(stream)]
        for i in range(1, 3):
            events.put_nowait(ChoiceDelta(0, f"t{i}"))
            writes.append(await anext(stream))  # sent before the next event exists
        events.put_nowait(ChoiceDone(0))
        writes.extend([w async for w in stream])
        return writes

    assert asyncio.run(main()) == ["", "data: t0\n\n", "data: t1\n\n", "data: t2\n\n", SSE_DONE]
