"""Which node takes a request: cache-aware (default), least-loaded or round-robin.

Cache-aware routing (after SGLang's and llm-d's prefix-aware routers): every node reports the
prefix_block_hashes keys of the KV blocks it caches (a PrefixCacheDigest in its LoadReport); the
proxy hashes each prompt once per block size (PromptBlocks) and looks up, for every node, how
many leading tokens of the prompt that node holds (its cached prefix). Then:

- **Prefill**: the node with the lowest cost = uncached prompt tokens + the prefill tokens
  queued on it (as reported, plus those this proxy sent since), i.e. the node that finishes this
  prompt's prefill first if every queued token costs the same. The cap: a node whose queued
  prefill tokens exceed the least-queued node's by more than max_extra_prefill_tokens (2,048 by
  default: one full prefill step of the default engine) is passed over however much it caches,
  so a hot prefix (a shared system prompt) cannot pile every request onto one node.
- **Decode**: among the nodes whose load (running + waiting + sent since the last report) is at
  most the least-loaded node's + max_extra_decode_requests (8 by default) and with free blocks
  for the prompt's uncached part, the one caching the longest prefix of the prompt (it pulls
  only the rest; the conversation's earlier turns are there), then the most free blocks. A node
  with a free slot (fewer requests than the max_num_seqs it reports) comes first, under every
  policy but round-robin: a cached prefix saves a pull, a full node makes the request wait for a
  whole other request to finish (the proxy's admission counts on this, proxy.admission).
- **Conditional disaggregation** (NodePool.pick_local_prefill) counts only uncached tokens on
  both sides: a mostly cached prompt is cheap to prefill on the decode node holding it.

The proxy's view of a node (PrefixView) is the newest digest it sent (None in a report means
unchanged; a new boot id empties it) plus, optimistically, the block hashes of every prompt this
proxy sent there in the last OPTIMISTIC_TTL_S: a digest lags up to a few seconds, and the next
turn of a conversation that arrives before the node's next digest must still find its prefix
there. A node without a digest yet caches nothing as far as routing knows.

Each choice is counted on the chosen node by reason (NodeClient.routing_decisions, exported as
pdserve_routing_decisions_total): "cache" (the node caching the longest prefix), "load" (no node
caches any of it, or a less loaded node was worth more than the cached tokens), "cap" (a node
caching more was past the cap), "slot" (a node caching more had no free slot), "round_robin",
"least_loaded".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine import protocol
from engine.protocol import default_of
from proxy.config import ProxyConfig, RoutingPolicy

if TYPE_CHECKING:
    from proxy.node_client import NodeClient

# NOTE: how long a prompt sent to a node counts as cached there without the node's digest
# saying so. A conversation's next turn starts after its previous one ended, and the node's
# digest follows a change within about a second: the window only has to cover that lag after a
# prefill that may itself take many seconds on a loaded node. A node that evicted those blocks
# meanwhile costs one misrouted request per conversation at worst.
OPTIMISTIC_TTL_S = 30.0


@dataclass(frozen=True)
class RoutingConfig:
    """The routing rule and its caps (ProxyConfig's routing* fields, where the defaults live)."""

    policy: RoutingPolicy = default_of(ProxyConfig, "routing")
    max_extra_prefill_tokens: int = default_of(ProxyConfig, "routing_max_extra_prefill_tokens")
    max_extra_decode_requests: int = default_of(ProxyConfig, "routing_max_extra_decode_requests")

    @classmethod
    def of(cls, config: ProxyConfig) -> RoutingConfig:
        return cls(RoutingPolicy(config.routing), config.routing_max_extra_prefill_tokens,
                   config.routing_max_extra_decode_requests)


class PromptBlocks:
    """A prompt's token ids and their prefix_block_hashes, computed once per block size (nodes
    report theirs; every node of a deployment normally shares one)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = protocol.prefix_block_hashes(self.token_ids, block_size)
        return hashes


@dataclass
class PrefixView:
    """What this proxy believes one node caches: its newest digest and the prompts sent there
    within OPTIMISTIC_TTL_S (hash -> when that stops counting), at most MAX_DIGEST_BLOCKS of them."""

    boot_id: str | None = None
    version: int = -1
    digest: frozenset[int] = frozenset()
    optimistic: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def take(self, report: protocol.LoadReport) -> None:
        """Keep the report's digest if newer than the one held; a new boot id (a restarted
        node, an empty cache) forgets everything first."""
        if report.boot_id != self.boot_id:
            self.boot_id, self.version, self.digest = report.boot_id, -1, frozenset()
            self.optimistic.clear()
        digest = report.prefix_cache
        if digest is not None and digest.version > self.version:
            self.version, self.digest = digest.version, frozenset(digest.block_hashes)

    def add(self, block_hashes: list[int], now: float | None = None) -> None:
        """Count these blocks as cached on the node for OPTIMISTIC_TTL_S (a prompt sent there)."""
        expires_at = (time.monotonic() if now is None else now) + OPTIMISTIC_TTL_S
        for block_hash in block_hashes:
            self.optimistic[block_hash] = expires_at
            self.optimistic.move_to_end(block_hash)
        while len(self.optimistic) > protocol.MAX_DIGEST_BLOCKS:
            self.optimistic.popitem(last=False)

    def num_cached_blocks(self, block_hashes: list[int], now: float | None = None) -> int:
        """Leading blocks of block_hashes the node holds (a chained hash names its whole prefix)."""
        now = time.monotonic() if now is None else now
        num_cached = 0
        for block_hash in block_hashes:
            if block_hash not in self.digest and self.optimistic.get(block_hash, 0.0) <= now:
                break
            num_cached += 1
        return num_cached


def num_cached_tokens(node: NodeClient, prompt: PromptBlocks | None) -> int:
    """Leading prompt tokens the node holds, as this proxy knows; at most all but the last
    token (a node always computes that one for its logits)."""
    if prompt is None or node.last_report is None:
        return 0
    block_size = node.last_report.block_size
    num_blocks = node.prefix.num_cached_blocks(prompt.hashes(block_size))
    return min(num_blocks * block_size, max(len(prompt) - 1, 0))


def decode_score(node: NodeClient) -> tuple[bool, int, int]:
    """A free slot first; then free blocks left once the requests the node accepted and those
    sent since its last report take theirs (in the node's own block size); then fewest requests."""
    return has_free_slot(node), num_unclaimed_blocks(node), -decode_load(node)


def has_free_slot(node: NodeClient) -> bool:
    """Whether a decode node would run one more request at once: it holds fewer than its slots
    (decode_slots); a node that says nothing of them counts as having one."""
    slots = decode_slots(node)
    return slots is None or decode_held(node) < slots


def decode_slots(node: NodeClient) -> int | None:
    """The requests a decode node runs at once: while it reports a queue, those it runs (fewer than
    max_num_seqs when KV blocks ran short); else the max_num_seqs it reports; None: not said."""
    report = node.last_report
    if report.num_waiting + report.num_pending_pulls:
        return report.num_running
    return report.max_num_seqs or None


def decode_held(node: NodeClient) -> int:
    """Requests on a decode node, running or not yet: reported running, waiting and pulling, and
    those sent since its report."""
    return decode_load(node) + node.last_report.num_pending_pulls


def num_unclaimed_blocks(node: NodeClient) -> int:
    """The node's free KV blocks less those its accepted requests still need (they take blocks
    only when scheduled) and those of the requests sent since its last report."""
    report = node.last_report
    return (report.num_free_blocks - report.num_promised_blocks
            - protocol.num_blocks_for(node.num_unreported_tokens, report.block_size))


def decode_load(node: NodeClient) -> int:
    """Requests on a decode node: reported running and waiting, plus those sent since."""
    report = node.last_report
    return report.num_running + report.num_waiting + len(node.unreported)


class Router:
    """Chooses among candidates (healthy, not full, able to pair: the pool filters them) and
    counts the choice on the chosen node. all_nodes: the pool's list of that kind, for
    round-robin's order."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._next_index = {"prefill": 0, "decode": 0}

    def pick_prefill(self, candidates: list[NodeClient], all_nodes: list[NodeClient],
                     prompt: PromptBlocks | None) -> NodeClient:
        policy = self.config.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            return _count(self._round_robin("prefill", candidates, all_nodes), "round_robin")
        if policy is RoutingPolicy.LEAST_LOADED or prompt is None:
            return _count(min(candidates, key=lambda n: n.last_report.num_queued_prompt_tokens
                              + n.num_unreported_tokens), "least_loaded")
        return self._cache_aware_prefill(candidates, prompt)

    def pick_decode(self, candidates: list[NodeClient], all_nodes: list[NodeClient],
                    prompt: PromptBlocks | None) -> NodeClient:
        policy = self.config.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            return _count(self._round_robin("decode", candidates, all_nodes), "round_robin")
        if policy is RoutingPolicy.LEAST_LOADED or prompt is None:
            return _count(max(candidates, key=decode_score), "least_loaded")
        return self._cache_aware_decode(candidates, prompt)

    def _round_robin(self, kind: str, candidates: list[NodeClient], all_nodes: list[NodeClient]) -> NodeClient:
        """The first candidate at or after the one past the last pick, in the pool's order."""
        order = {id(n): i for i, n in enumerate(all_nodes)}
        start = self._next_index[kind]
        chosen = min(candidates, key=lambda n: (order[id(n)] - start) % len(all_nodes))
        self._next_index[kind] = order[id(chosen)] + 1
        return chosen

    def _cache_aware_prefill(self, candidates: list[NodeClient], prompt: PromptBlocks) -> NodeClient:
        cached = {id(n): num_cached_tokens(n, prompt) for n in candidates}
        queued = {id(n): n.num_queued_prefill_tokens for n in candidates}
        least_queued = min(queued.values())
        eligible = [n for n in candidates if queued[id(n)] <= least_queued + self.config.max_extra_prefill_tokens]
        chosen = min(eligible, key=lambda n: (len(prompt) - cached[id(n)] + queued[id(n)], -cached[id(n)]))
        return _count(chosen, _reason(cached, eligible, chosen))

    def _cache_aware_decode(self, candidates: list[NodeClient], prompt: PromptBlocks) -> NodeClient:
        cached = {id(n): num_cached_tokens(n, prompt) for n in candidates}
        least_load = min(decode_load(n) for n in candidates)

        def has_room(node: NodeClient) -> bool:
            block_size = node.last_report.block_size
            needed = protocol.num_blocks_for(len(prompt), block_size) - cached[id(node)] // block_size
            return num_unclaimed_blocks(node) >= needed

        eligible = [n for n in candidates
                    if decode_load(n) <= least_load + self.config.max_extra_decode_requests and has_room(n)]
        if not eligible:  # every node short of blocks: the usual choice (a free slot, then most free blocks)
            return _count(max(candidates, key=decode_score), "load")
        with_slot = [n for n in eligible if has_free_slot(n)]
        chosen = max(with_slot or eligible, key=lambda n: (cached[id(n)], decode_score(n)))
        if with_slot and max(cached[id(n)] for n in eligible) > cached[id(chosen)]:
            return _count(chosen, "slot")
        return _count(chosen, _reason(cached, eligible, chosen))


def _reason(cached: dict[int, int], eligible: list[NodeClient], chosen: NodeClient) -> str:
    """Why chosen among the candidates whose cached prefixes are in cached (by id())."""
    most = max(cached.values())
    if most == 0 or cached[id(chosen)] == most:
        return "cache" if most > 0 else "load"
    if max(cached[id(n)] for n in eligible) < most:
        return "cap"
    return "load"


def _count(node: NodeClient, reason: str) -> NodeClient:
    node.routing_decisions[reason] += 1
    return node
