"""The real PrefillNode and DecodeNode over the fake transport, driven message by message (no
proxy, no loop thread): a pull that succeeds, fails, hangs, meets another layout or a restarted
holder, is aborted while queued or mid-way, waits for blocks (back-pressure), a lease that
expires, a lease renewed while its request waits, and a read whose lease ended first (its
blocks reused by another prompt), which is discarded. Every test ends with both engines holding
no block and no request."""

from __future__ import annotations

import time

import pytest
import torch

from engine import protocol
from kv_transfer.base import RemoteLease
from kv_transfer.config import TransferConfig
from kv_transfer.fake import FakeConnector
from node.transfer import kv_layout
from tests.nodes.conftest import (
    PROMPT,
    PROXY,
    assert_nothing_held,
    assert_nothing_held_once_released,
    colocated_greedy,
)


@pytest.fixture(scope="module")
def expected_tokens(tiny_model_dir) -> list[int]:
    """The greedy continuation of PROMPT from a colocated engine."""
    return colocated_greedy(tiny_model_dir)


def test_pull_copies_the_prompt_kv_and_decodes_as_colocated(pair, expected_tokens):
    result = pair.prefill_prompt("a")
    assert result.kv_handle is not None and len(result.kv_handle.block_ids) == 3 and len(pair.prefill.leases) == 1
    remote_kv = pair.prefill.engine.kv_cache[result.kv_handle.block_ids].clone()
    pair.send_decode("a", result)
    pair.run(lambda: pair.decode.engine.has_unfinished())
    request = pair.decode.engine.scheduler.running[0]
    local_kv = pair.decode.engine.kv_cache[request.block_ids]
    num_in_last = len(PROMPT) - 2 * 16  # the prompt's tokens in its partial last block
    assert torch.equal(local_kv[:2], remote_kv[:2])  # (the first decode step may have written past the prompt)
    assert torch.equal(local_kv[2, :, :, :num_in_last], remote_kv[2, :, :, :num_in_last])
    pair.run(lambda: pair.tokens_of("a") is not None)
    assert pair.tokens_of("a") == expected_tokens
    assert pair.decode.num_kv_fallbacks == 0
    deltas = pair.deltas_of("a")
    assert deltas[0].kv == protocol.KVOutcome(protocol.KVSource.PULLED) and all(d.kv is None for d in deltas[1:])
    assert [d.first_token_idx for d in deltas] == list(range(1, len(expected_tokens)))  # token 0: the prefill's
    assert_nothing_held_once_released(pair)
    assert pair.prefill.num_expired_leases == 0


def test_a_pull_first_waits_for_late_writes_into_its_blocks(pair, expected_tokens, monkeypatch):
    """Before its read starts, the decode node asks its engine to settle the blocks it will fill
    (an async step may still write a slot of a request that ended: LLMEngine.wait_for_late_writes)."""
    order = []
    real_wait, real_read = pair.decode.engine.wait_for_late_writes, pair.decode.connector.start_read
    monkeypatch.setattr(pair.decode.engine, "wait_for_late_writes",
                        lambda ids: (order.append(("wait", list(ids))), real_wait(ids))[1])
    monkeypatch.setattr(pair.decode.connector, "start_read",
                        lambda rid, lease, ids: (order.append(("read", list(ids))), real_read(rid, lease, ids))[1])
    pair.send_decode("w", pair.prefill_prompt("w"))
    pair.run(lambda: pair.tokens_of("w") is not None)
    assert [kind for kind, _ in order] == ["wait", "read"] and order[0][1] == order[1][1] and order[0][1]
    assert pair.tokens_of("w") == expected_tokens
    assert_nothing_held_once_released(pair)


def test_failed_pull_falls_back_to_local_prefill_and_frees_both_sides(pair, expected_tokens):
    pair.decode.connector.inject("a", "fail")  # the read of "a", when it starts
    pair.pull("a")
    pair.run(lambda: pair.tokens_of("a") is not None)
    assert pair.decode.num_kv_fallbacks == 1 and pair.decode.num_kv_fallbacks_by_reason == {"transfer": 1}
    assert pair.tokens_of("a") == expected_tokens  # recomputed locally: the same answer
    assert pair.deltas_of("a")[0].kv == protocol.KVOutcome(protocol.KVSource.FALLBACK,
                                                           protocol.KVFallbackReason.TRANSFER)
    assert_nothing_held_once_released(pair)


def test_pull_that_never_completes_times_out_then_falls_back(pair, expected_tokens):
    pair.decode.connector.inject("a", "hang")
    pair.pull("a")
    for _ in range(5):
        pair.decode.run_once()
    assert pair.decode.has_pending_work() and pair.decode.num_kv_fallbacks == 0
    pair.clock.now += 5.1  # past the reader's transfer_timeout_s
    pair.run(lambda: pair.tokens_of("a") is not None)
    assert pair.decode.num_kv_fallbacks_by_reason == {"timeout": 1} and pair.tokens_of("a") == expected_tokens
    assert_nothing_held_once_released(pair)


def test_layout_mismatch_is_never_read_fails_the_request_loudly_and_frees_both_sides(pair_factory):
    pair = pair_factory(decode_dtype="bfloat16")
    assert pair.prefill.kv_layout_info().fingerprint != pair.decode.kv_layout_info().fingerprint
    pair.pull("a")
    pair.run(lambda: pair.results(protocol.ErrorReply))
    [error] = pair.results(protocol.ErrorReply)
    assert error.request_id == "a" and error.kind == "LayoutMismatch" and not error.is_client_error
    assert "dtype: local 'bfloat16', remote 'float32'" in error.message
    assert pair.decode.num_kv_fallbacks == 0 and pair.decode.num_kv_refusals == 1  # never a silent fallback
    assert pair.tokens_of("a") is None
    assert_nothing_held_once_released(pair)


def test_abort_mid_pull_frees_both_sides_and_writes_nothing(pair_factory):
    pair = pair_factory(num_polls_per_read=3)
    pair.decode.engine.kv_cache.fill_(float("nan"))
    pair.pull("a")
    pair.decode.run_once()
    assert pair.decode.connector.num_reads_in_flight == 1  # under way
    pair.decode.handle_message(PROXY, protocol.Abort(["a"]))
    for _ in range(5):
        pair.decode.run_once()
    assert pair.decode.engine.kv_cache.isnan().all()  # the aborted read wrote nothing
    assert not pair.results(protocol.TokenBatch) and not pair.results(protocol.ErrorReply)
    assert_nothing_held_once_released(pair)


def test_an_aborted_pull_whose_transfer_cannot_stop_keeps_its_blocks_until_it_ended(pair_factory):
    """The connector cannot stop the read's transfer (abort_read says False): its blocks stay
    taken, and its request id in use, until the connector reports the read, then are freed."""
    pair = pair_factory(num_polls_per_read=3)
    pair.decode.connector.inject("a", "stuck")
    pair.pull("a")
    pair.decode.run_once()
    taken = pair.decode.engine.block_pool.num_blocks - pair.decode.engine.num_free_blocks
    assert taken == 3 and pair.decode.connector.num_reads_in_flight == 1
    pair.decode.handle_message(PROXY, protocol.Abort(["a"]))
    for _ in range(5):
        pair.decode.run_once()
    assert pair.decode.engine.block_pool.num_blocks - pair.decode.engine.num_free_blocks == taken
    assert pair.decode.has_request("a") and pair.decode.has_pending_work()
    pair.decode.connector.unstick("a")
    pair.decode.run_once()
    assert not pair.decode.has_request("a") and pair.decode.num_kv_blocks_lost == 0
    assert not pair.results(protocol.TokenBatch) and not pair.results(protocol.ErrorReply)
    assert_nothing_held_once_released(pair)


def test_a_pull_whose_transfer_never_stops_falls_back_and_its_blocks_stay_out_of_use(pair, expected_tokens):
    """A timed-out read whose transfer cannot be stopped: no fallback while the connector waits
    for it; after another transfer timeout, the request is prefilled locally and the 3 blocks
    the transfer may still write stay taken for good."""
    pair.decode.connector.inject("a", "stuck")
    pair.pull("a")
    pair.decode.run_once()
    pair.clock.now += 5.1  # past the reader's transfer_timeout_s: the read failed, its transfer runs on
    for _ in range(5):
        pair.decode.run_once()
    assert pair.decode.num_kv_fallbacks == 0 and pair.decode.has_pending_work()
    pair.clock.now += 5.1  # and past another: the connector gives up on the transfer
    pair.run(lambda: pair.tokens_of("a") is not None)
    assert pair.decode.num_kv_fallbacks_by_reason == {"timeout": 1} and pair.tokens_of("a") == expected_tokens
    assert pair.decode.num_kv_blocks_lost == 3 and pair.decode.load_extras()["num_kv_blocks_lost"] == 3
    pair.run(lambda: not pair.decode.engine.has_unfinished())
    assert pair.decode.engine.block_pool.num_blocks - pair.decode.engine.num_free_blocks == 3


def test_back_pressure_queues_pulls_until_blocks_free_and_abort_while_queued_releases(pair_factory, expected_tokens):
    pair = pair_factory(decode_blocks=4)  # one request (3 prompt blocks + 1 for its tokens) at a time
    first, second, third = (pair.prefill_prompt(rid) for rid in ("a", "b", "c"))
    for rid, result in (("a", first), ("b", second), ("c", third)):
        pair.send_decode(rid, result)
    pair.decode.run_once()
    assert pair.decode.connector.num_reads_in_flight + pair.decode.engine.num_unfinished == 1
    # The two queued pulls hold no blocks yet; the load report promises them their prompts' 3 each.
    assert pair.decode.num_promised_blocks() == 6
    pair.decode.handle_message(PROXY, protocol.Abort(["c"]))  # still queued: nothing allocated for it
    assert pair.decode.num_promised_blocks() == 3
    pair.run(lambda: pair.tokens_of("a") is not None and pair.tokens_of("b") is not None)
    assert pair.tokens_of("a") == pair.tokens_of("b") == expected_tokens
    assert pair.tokens_of("c") is None and pair.decode.num_kv_fallbacks == 0
    assert_nothing_held_once_released(pair)


def test_restarted_holder_is_not_read_under_its_old_engine_id(pair, expected_tokens):
    result = pair.prefill_prompt("a")
    address = pair.prefill.connector.agent_address
    pair.prefill.connector.close()  # the prefill node restarts on the same port
    config = TransferConfig(backend="fake", side_channel_port=int(address.split(":")[1]))
    restarted = FakeConnector(config, pair.prefill.engine.kv_cache, kv_layout(pair.prefill.engine), "holder-new",
                              pair.registry)
    assert restarted.agent_address == address
    pair.send_decode("a", result)
    pair.run(lambda: pair.tokens_of("a") is not None)
    assert pair.decode.num_kv_fallbacks_by_reason == {"handshake": 1} and pair.tokens_of("a") == expected_tokens
    pair.prefill.connector = restarted
    pair.prefill.handle_message(PROXY, protocol.ReleaseKV(["a"]))  # the old lease: what the proxy sends
    assert_nothing_held_once_released(pair)


def test_unread_lease_expires_and_a_late_release_frees_nothing_twice(pair_factory):
    pair = pair_factory(lease_timeout_s=0.2)
    handle = pair.prefill_prompt("a").kv_handle
    assert len(pair.prefill.leases) == 1
    deadline = time.monotonic() + 5
    while len(pair.prefill.leases) and time.monotonic() < deadline:
        pair.prefill.run_once()
    assert pair.prefill.num_expired_leases == 1
    pair.prefill_prompt("b")  # reuses the freed blocks
    lease = RemoteLease(handle.engine_id, handle.agent_address, handle.block_ids, handle.generation,
                        handle.lease_timeout_s)
    pair.decode.connector.release_remote("a", lease)
    pair.prefill.run_once()
    assert pair.prefill.leases.request_ids() == ["b"]
    assert pair.prefill.engine.num_free_blocks == pair.prefill.engine.block_pool.num_blocks - 3
    pair.prefill.handle_message(PROXY, protocol.ReleaseKV(["b"]))
    assert_nothing_held(pair)


OTHER_PROMPT = [(11 * i + 5) % 2000 + 8 for i in range(37)]  # as many blocks as PROMPT, other KV


def wait_past(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_lease_renewed_while_its_request_waits_outlives_its_timeout(pair_factory, expected_tokens):
    pair = pair_factory(lease_timeout_s=0.6, decode_max_seqs=1)  # "b" waits until "a" is done
    first, second = pair.prefill_prompt("a"), pair.prefill_prompt("b")
    pair.send_decode("a", first)
    pair.send_decode("b", second)
    pair.decode.run_once()
    for _ in range(6):  # 1.2 s queued: 2 lease timeouts, renewed every 0.2 s as the keeper does
        wait_past(0.2)
        pair.decode.connector.renew_held()
        pair.prefill.run_once()
    assert pair.prefill.num_expired_leases == 0 and "b" in pair.prefill.leases

    def both_done() -> bool:
        pair.decode.connector.renew_held()  # the keeper goes on renewing while "b" waits
        return pair.tokens_of("a") is not None and pair.tokens_of("b") is not None

    pair.run(both_done)
    assert pair.tokens_of("a") == pair.tokens_of("b") == expected_tokens and pair.decode.num_kv_fallbacks == 0
    assert_nothing_held_once_released(pair)


def test_read_after_the_lease_ended_and_its_blocks_were_reused_is_discarded(pair_factory, expected_tokens):
    pair = pair_factory(lease_timeout_s=1.0, prefill_blocks=3)  # one prompt's blocks: reused at once
    first = pair.prefill_prompt("a")
    wait_past(1.05)  # nobody renews: the lease ends before the decode node pulls
    pair.prefill.run_once()
    assert pair.prefill.num_expired_leases == 1 and len(pair.prefill.leases) == 0
    other = pair.prefill_prompt("b", OTHER_PROMPT)  # another prompt's KV in the same blocks
    assert sorted(other.kv_handle.block_ids) == sorted(first.kv_handle.block_ids)
    pair.send_decode("a", first)
    pair.decode.run_once()  # the read copies "b"'s KV; its lease is not confirmed: discarded
    assert pair.decode.num_kv_fallbacks_by_reason == {"lease_lost": 1}
    assert "b" in pair.prefill.leases  # the lease of the prompt whose blocks were read is untouched
    pair.run(lambda: pair.tokens_of("a") is not None)
    assert pair.tokens_of("a") == expected_tokens  # recomputed locally
    assert pair.deltas_of("a")[0].kv.label == "fallback:lease_lost"
    pair.prefill.handle_message(PROXY, protocol.ReleaseKV(["b"]))
    assert_nothing_held_once_released(pair)


def test_the_loop_waits_on_the_connectors_wake_sockets_and_looks_again_at_once_while_it_copies(pair, monkeypatch):
    """A pull's confirmation coming back ends the decode node's wait (not its next poll, ms later);
    a device copy under way has it look again at once."""
    waits = []
    monkeypatch.setattr(pair.decode.control, "poll", lambda timeout_ms, also=(): waits.append((timeout_ms, also)))
    socket = object()
    monkeypatch.setattr(pair.decode.connector, "wake_sockets", lambda: [socket])
    pair.decode.run_once()
    assert waits[-1][0] > 0 and waits[-1][1] == [socket]
    monkeypatch.setattr(type(pair.decode.connector), "is_copying", property(lambda _: True))
    pair.decode.run_once()
    assert waits[-1] == (0, ())
