"""Streamed pulls between the real PrefillNode and DecodeNode over the fake transport, driven by
hand with the proxy's part played by Relay: the decode node reads each chunk's blocks while the
prompt is still prefilled, then the rest under the confirmation; a stream whose lease ended or
whose prompt was preempted is read again under the new lease; a failed part is read again with
the rest; aborts and early finishes leave nothing held on either side."""

from __future__ import annotations

import time

import pytest
import torch

from engine import protocol
from engine.sampling_params import SamplingParams
from tests.nodes.conftest import (
    GREEDY,
    PROMPT,
    PROXY,
    assert_nothing_held,
    assert_nothing_held_once_released,
    colocated_greedy,
    release_notices_processed,
)
from tests.nodes.test_metrics import block_bytes, sample_values, value

LONG = [(11 * i + 5) % 2000 + 8 for i in range(80)]  # 5 blocks of 16, in 16-token chunks: 4 KVProgress


class Relay:
    """What the proxy does with a streamed request: PrefillRequest(stream_kv) to the prefill node;
    its first KVProgress becomes the decode node's DecodeRequest, the others go on as they are,
    and its PrefillResult becomes the last KVProgress (or, finished at once, an Abort)."""

    def __init__(self, pair, request_id: str, prompt: list[int], sampling=GREEDY) -> None:
        self.pair, self.request_id, self.prompt, self.sampling = pair, request_id, prompt, sampling
        self.seen = 0
        self.progress: list[protocol.KVProgress] = []
        self.result: protocol.PrefillResult | None = None
        self.is_decode_started = False
        pair.prefill.handle_message(PROXY, protocol.PrefillRequest(request_id, prompt, sampling, stream_kv=True))

    def pump(self) -> None:
        sent = self.pair.sent
        while self.seen < len(sent):
            message = sent[self.seen]
            self.seen += 1
            if getattr(message, "request_id", None) != self.request_id:
                continue
            if isinstance(message, protocol.KVProgress):
                self.progress.append(message)
                self._to_decode(message.kv_handle, None)
            elif isinstance(message, protocol.PrefillResult):
                self.result = message
                if message.finish_reason is not None:
                    if self.is_decode_started:
                        self.pair.decode.handle_message(PROXY, protocol.Abort([self.request_id]))
                else:
                    self._to_decode(message.kv_handle, message.first_token)

    def _to_decode(self, handle: protocol.KVHandle, first_token) -> None:
        decode = self.pair.decode
        if self.is_decode_started:
            decode.handle_message(PROXY, protocol.KVProgress(self.request_id, handle, first_token))
        else:
            self.is_decode_started = True
            decode.handle_message(PROXY, protocol.DecodeRequest(self.request_id, self.prompt, self.sampling,
                                                                first_token, handle))

    def run(self, until, max_rounds: int = 400) -> None:
        for _ in range(max_rounds):
            if until():
                return
            self.pump()
            if until():
                return
            self.pair.prefill.run_once()
            self.pair.decode.run_once()
        raise AssertionError(f"not done after {max_rounds} rounds; sent: {self.pair.sent}")


@pytest.fixture
def reads(pair_factory):
    """A pair whose prefill engine runs 16-token chunks, and the decode node's reads as they start:
    (remote block ids, local block ids, confirm, whether the prefill had finished)."""
    pair = pair_factory(prefill_chunk=16)
    started = []
    real = pair.decode.connector.start_read

    def start_read(request_id, lease, local, confirm=True):
        finished = any(isinstance(m, protocol.PrefillResult) for m in pair.sent)
        started.append((list(lease.block_ids), list(local), confirm, finished))
        real(request_id, lease, local, confirm=confirm)

    pair.decode.connector.start_read = start_read
    return pair, started


def test_a_streamed_pull_reads_each_chunk_while_the_prompt_is_prefilled_and_decodes_as_colocated(reads,
                                                                                                tiny_model_dir):
    pair, started = reads
    relay = Relay(pair, "s", LONG)
    relay.run(lambda: pair.tokens_of("s") is not None)
    assert pair.tokens_of("s") == colocated_greedy(tiny_model_dir, LONG)
    handle = relay.result.kv_handle
    assert [len(p.kv_handle.block_ids) for p in relay.progress] == [1, 2, 3, 4]
    assert {p.kv_handle.generation for p in relay.progress} == {handle.generation}  # one lease throughout
    assert all(p.kv_handle.block_ids == handle.block_ids[:len(p.kv_handle.block_ids)] for p in relay.progress)
    # Each part names only blocks no later chunk writes, read (unconfirmed) before the prompt
    # finished; the last read, confirmed, takes the rest.
    parts, last = started[:-1], started[-1]
    assert [remote for remote, _, _, _ in parts] == [[b] for b in handle.block_ids[:4]]
    assert not any(confirm or finished for _, _, confirm, finished in parts)
    assert last[0] == handle.block_ids[4:] and last[2] and last[3]
    local = [b for _, ids, _, _ in started for b in ids]
    assert len(set(local)) == 5
    assert pair.decode.load_extras()["num_kv_streamed"] == 1 and pair.prefill.load_extras()["num_kv_streamed"] == 1
    assert pair.decode.num_kv_fallbacks == 0
    assert pair.deltas_of("s")[0].kv == protocol.KVOutcome(protocol.KVSource.PULLED)
    assert_nothing_held_once_released(pair)


def test_the_streamed_kv_equals_the_prefill_nodes(reads):
    pair, _ = reads
    relay = Relay(pair, "k", LONG, protocol.SamplingOptions(max_tokens=40, temperature=0.0, ignore_eos=True))
    relay.run(lambda: pair.decode.engine.has_unfinished())
    remote = pair.prefill.engine.kv_cache[relay.result.kv_handle.block_ids].clone()
    request = pair.decode.engine.scheduler.running[0]
    local = pair.decode.engine.kv_cache[request.block_ids[:5]]
    assert torch.equal(local, remote)  # 80 tokens: 5 full blocks, the first decode step writes past them
    pair.decode.handle_message(PROXY, protocol.Abort(["k"]))
    assert_nothing_held_once_released(pair)


def test_a_stream_whose_lease_ended_mid_way_is_read_again_under_the_finished_prompts_lease(reads, tiny_model_dir):
    pair, started = reads
    relay = Relay(pair, "e", LONG)
    relay.run(lambda: len(started) >= 2)
    [(request_id, handed_back)] = pair.prefill.leases.pop_expired(now=float("inf"))  # as if it expired
    assert request_id == "e" and handed_back == []  # the blocks are still the running prompt's
    relay.run(lambda: pair.tokens_of("e") is not None)
    assert pair.tokens_of("e") == colocated_greedy(tiny_model_dir, LONG)
    handle = relay.result.kv_handle
    assert handle.generation != relay.progress[0].kv_handle.generation
    assert started[-1][0] == handle.block_ids and started[-1][2]  # every block, confirmed under the new lease
    assert pair.decode.num_kv_fallbacks == 0
    assert_nothing_held_once_released(pair)


def test_a_failed_part_is_read_again_with_the_rest_without_a_fallback(reads, tiny_model_dir):
    pair, started = reads
    pair.decode.connector.inject("f", "fail")  # its first read: the first part
    relay = Relay(pair, "f", LONG)
    relay.run(lambda: pair.tokens_of("f") is not None)
    assert pair.tokens_of("f") == colocated_greedy(tiny_model_dir, LONG)
    assert len(started) == 2 and not started[0][2]  # no more parts after the failed one
    assert started[1][0] == relay.result.kv_handle.block_ids and started[1][2]
    assert pair.decode.num_kv_fallbacks == 0
    assert_nothing_held_once_released(pair)


def test_a_failed_last_read_of_a_stream_falls_back(reads, tiny_model_dir):
    pair, started = reads
    relay = Relay(pair, "g", LONG)
    relay.run(lambda: pair.results(protocol.PrefillResult))  # not yet relayed
    pair.decode.connector.inject("g", "fail")  # the confirmed read of the rest
    relay.run(lambda: pair.tokens_of("g") is not None)
    assert pair.tokens_of("g") == colocated_greedy(tiny_model_dir, LONG)
    assert pair.decode.num_kv_fallbacks_by_reason == {"transfer": 1}
    assert_nothing_held_once_released(pair)


@pytest.mark.parametrize("at", ["queued", "part in flight", "between parts"])
def test_abort_mid_stream_frees_both_sides(pair_factory, at):
    pair = pair_factory(prefill_chunk=16, num_polls_per_read=3, decode_max_seqs=1 if at == "queued" else 8)
    if at == "queued":
        pair.decode.engine.add_request("other", PROMPT, SamplingParams.from_options(GREEDY))  # takes the one slot
    relay = Relay(pair, "a", LONG)
    in_flight = pair.decode.connector
    if at == "queued":
        relay.run(lambda: relay.is_decode_started)
    elif at == "part in flight":
        relay.run(lambda: in_flight.num_reads_in_flight == 1)
    else:
        relay.run(lambda: len(relay.progress) >= 2 and in_flight.num_reads_in_flight == 0)
    for node in (pair.prefill, pair.decode):
        node.handle_message(PROXY, protocol.Abort(["a"]))
    if at == "queued":
        pair.decode.engine.abort("other")
    assert_nothing_held_once_released(pair)
    assert not pair.results(protocol.ErrorReply) and not pair.prefill.engine.request_ids()


def test_a_prompt_ending_at_its_first_token_ends_its_stream_and_its_lease(reads):
    pair, _ = reads
    relay = Relay(pair, "one", LONG, protocol.SamplingOptions(max_tokens=1, temperature=0.0))
    relay.run(lambda: relay.result is not None)
    assert relay.result.finish_reason == "length" and relay.result.kv_handle is None and relay.progress
    assert_nothing_held_once_released(pair)


def test_a_preempted_prompt_ends_its_stream_and_is_read_whole_under_a_new_lease(pair_factory, tiny_model_dir):
    """Two prompts on a prefill engine of 5 blocks: the second, leased from its first chunk, is
    preempted when the first's lease holds 3 of them; its lease ends at once (its blocks may hold
    another prompt's KV by the time a reader confirms), and once it ran again its new lease is
    read whole."""
    pair = pair_factory(prefill_chunk=32, prefill_blocks=5)
    other = LONG[:len(PROMPT)]  # not PROMPT: no prefix of it is cached
    first = Relay(pair, "p1", PROMPT)
    second = Relay(pair, "p2", other)
    for _ in range(400):
        first.pump()
        second.pump()
        if pair.tokens_of("p1") is not None and pair.tokens_of("p2") is not None:
            break
        pair.prefill.run_once()
        pair.decode.run_once()
    assert pair.prefill.engine.scheduler.num_preemptions >= 1
    assert second.progress and second.result.kv_handle.generation != second.progress[0].kv_handle.generation
    assert pair.tokens_of("p1") == colocated_greedy(tiny_model_dir)
    assert pair.tokens_of("p2") == colocated_greedy(tiny_model_dir, other)
    assert pair.decode.num_kv_fallbacks == 0
    assert_nothing_held_once_released(pair)


def test_the_last_handle_of_a_request_ended_here_is_released_at_once(pair):
    result = pair.prefill_prompt("gone")
    pair.decode.handle_message(PROXY, protocol.KVProgress("gone", result.kv_handle, result.first_token))
    assert_nothing_held_once_released(pair)  # the prefill node's lease ended without waiting out its timeout


def test_a_streamed_handle_that_names_the_whole_prompt_is_refused(pair):
    result = pair.prefill_prompt("bad")
    pair.decode.handle_message(PROXY, protocol.DecodeRequest("bad", PROMPT, GREEDY, None, result.kv_handle))
    [error] = pair.results(protocol.ErrorReply)
    assert error.is_client_error and "streamed KV handle has 37 tokens in 3 blocks" in error.message
    assert_nothing_held_once_released(pair)


def test_a_streamed_pull_is_counted_on_both_nodes_metrics(pair_factory, tiny_model_dir):
    pair = pair_factory(prefill_chunk=16, metered=True)
    relay = Relay(pair, "m", LONG)
    relay.run(lambda: pair.results(protocol.PrefillResult))
    time.sleep(1.5)  # as if the prefill's last steps took that long
    relay.run(lambda: pair.tokens_of("m") is not None)
    pair.run(release_notices_processed(pair))
    pair.prefill.run_once()
    pair.decode.run_once()  # one more load snapshot each
    prefill = sample_values(pair.prefill.metrics.render().decode())
    decode = sample_values(pair.decode.metrics.render().decode())
    assert value(prefill, "pdserve_node_kv_streamed_total") == 1 == value(decode, "pdserve_node_kv_streamed_total")
    assert value(prefill, "pdserve_node_kv_lease_hold_seconds_count") == 1  # one lease throughout
    assert value(decode, "pdserve_node_kv_pulled_blocks_total") == 5
    assert value(decode, "pdserve_node_kv_pulled_bytes_total") == 5 * block_bytes(tiny_model_dir)
    assert value(decode, "pdserve_node_kv_pull_seconds_count") == 5  # four parts and the rest
    assert value(decode, "pdserve_node_kv_pull_wait_seconds_count") == 1
    assert value(decode, "pdserve_node_kv_pull_fallbacks_total") == 0
    # The decode node's request metrics start at the last KVProgress, as a whole pull's at its
    # request: here 1.5 s after the first chunk reached it.
    assert value(decode, "vllm:e2e_request_latency_seconds_sum") < 1.5
    assert_nothing_held(pair)


def test_a_stream_waiting_for_its_next_chunk_keeps_its_node_from_draining_but_not_busy(reads, pair_factory):
    """The decode node's loop looks every 2 ms only while a read is in flight: a stream waiting for
    the next KVProgress is woken by its arrival (a long prefill would spin the loop throughout)."""
    pair, started = reads
    relay = Relay(pair, "w", LONG)
    relay.run(lambda: started and pair.decode.connector.num_reads_in_flight == 0)
    assert relay.result is None and not pair.decode.needs_polling()
    assert pair.decode.has_pending_work()  # still a request here: the node does not count as drained
    relay.run(lambda: pair.tokens_of("w") is not None)
    assert_nothing_held_once_released(pair)
    hung = pair_factory(prefill_chunk=16)
    hung.decode.connector.inject("h", "hang")
    relay = Relay(hung, "h", LONG)
    relay.run(lambda: hung.decode.connector.num_reads_in_flight == 1)
    assert hung.decode.needs_polling()  # a read in flight
    for node in (hung.prefill, hung.decode):
        node.handle_message(PROXY, protocol.Abort(["h"]))
    assert_nothing_held_once_released(hung)
