"""proxy.node_client.MessageQueue: each wait for a node's message is bounded, with one timer per
queue that moves instead of one armed and cancelled per message."""

from __future__ import annotations

import asyncio

import pytest

from proxy.node_client import MessageQueue, NodeClient


def _run(coro):
    return asyncio.run(coro)


def test_a_wait_with_no_message_times_out_after_its_bound_and_not_before():
    async def main():
        queue = MessageQueue()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await queue.next_within(0.05)
        return loop.time() - start

    assert _run(main()) >= 0.05


def test_each_wait_is_bounded_on_its_own_so_a_steady_stream_never_times_out():
    async def main():
        queue = MessageQueue()

        async def feed():
            for i in range(8):
                await asyncio.sleep(0.02)  # every gap under the bound, all of them together over it
                queue.put_nowait(i)

        feeder = asyncio.create_task(feed())
        got = [await queue.next_within(0.06) for _ in range(8)]
        await feeder
        with pytest.raises(TimeoutError):  # and then nothing more comes
            await queue.next_within(0.03)
        return got

    assert _run(main()) == list(range(8))


def test_a_wait_still_running_when_an_earlier_waits_timer_goes_off_is_still_bounded():
    async def main():
        queue = MessageQueue()
        asyncio.get_running_loop().call_later(0.03, queue.put_nowait, "first")
        assert await queue.next_within(0.05) == "first"
        # this wait ends at about 0.08 s; the timer armed for the first goes off at 0.05 s, mid-wait
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.next_within(0.05), 2.0)  # NOTE: the guard, longer than the bound

    _run(main())


def test_a_shorter_bound_after_a_longer_one_still_holds():
    async def main():
        queue = MessageQueue()
        queue.put_nowait("first")
        assert await queue.next_within(60.0) == "first"
        loop = asyncio.get_running_loop()
        asyncio.get_running_loop().call_later(0.01, queue.put_nowait, "second")
        assert await queue.next_within(60.0) == "second"  # the timer is armed 60 s out now
        start = loop.time()
        with pytest.raises(TimeoutError):
            await queue.next_within(0.05)
        return loop.time() - start

    assert _run(main()) < 5.0


def test_an_expiry_that_crossed_a_message_is_not_taken_for_a_later_wait():
    async def main():
        queue = MessageQueue()
        waiter = asyncio.create_task(queue.next_within(0.02))
        await asyncio.sleep(0)  # it waits now
        loop = asyncio.get_running_loop()
        # the message lands in the same loop turn the timer goes off in, just before it
        loop.call_at(queue._timer.when() - 1e-9, queue.put_nowait, "message")
        await asyncio.sleep(0.05)
        assert waiter.result() == "message"
        assert queue.qsize() == 1  # the expiry, left behind it
        queue.put_nowait("next")
        return await queue.next_within(1.0), queue.ready()

    assert _run(main()) == ("next", None)


def test_reads_of_a_busy_stream_arm_no_timer_per_message():
    async def main():
        queue = MessageQueue()
        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kwargs):
            armed.append(when)
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counting_call_at

        async def feed():
            for i in range(200):
                queue.put_nowait(i)
                await asyncio.sleep(0)

        feeder = asyncio.create_task(feed())
        got = [await queue.next_within(30.0) for _ in range(200)]
        await feeder
        return got, len(armed)

    got, num_armed = _run(main())
    assert got == list(range(200))
    assert num_armed == 1


def test_a_cancelled_wait_leaves_the_message_for_the_next():
    async def main():
        queue = MessageQueue()
        waiter = asyncio.create_task(queue.next_within(10.0))
        await asyncio.sleep(0)
        queue.put_nowait("message")
        waiter.cancel()  # lands as the queue hands the message over
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return await queue.next_within(0.01)

    assert _run(main()) == "message"


def test_closing_a_request_stops_its_queues_timer():
    async def main():
        node = NodeClient("127.0.0.1:1", "decode", heartbeat_timeout_s=3.0)
        queue = node.open("r1")
        waiter = asyncio.create_task(queue.next_within(30.0))
        await asyncio.sleep(0)
        timer = queue._timer
        queue.put_nowait("last")
        assert await waiter == "last"
        node.close("r1")
        return timer.cancelled(), queue._timer, node.queues

    assert _run(main()) == (True, None, {})
