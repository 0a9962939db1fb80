"""Where the proxy's nodes come from, and how the set changes without a restart.

Four sources, merged: the static addresses (--prefill/--decode), DNS names re-resolved every
--discovery-interval-s (--prefill-dns/--decode-dns HOST:PORT, every A record a node: a
Kubernetes headless Service lists each ready pod), a node file re-read when it changes
(--nodes-file, YAML or JSON), and the admin endpoint (proxy.admin). A node that some source
lists joins at once; one that no source lists any more is retired: it gets no new requests and
leaves the pool once the requests it holds have ended. A failed DNS lookup or an unreadable
file keeps that source's last good answer (a resolver hiccup must not empty the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from proxy.config import is_loopback_host
from proxy.node_client import NodeClient
from proxy.node_names import NodeNames
from proxy.nodes import NodePool

logger = logging.getLogger(__name__)

KINDS = ("prefill", "decode")
SOURCES = ("static", "dns", "file", "admin")
# How often retiring nodes are checked for their last request (their removal is this prompt).
_SWEEP_INTERVAL_S = 0.2

Addresses = dict[str, frozenset[str]]  # kind -> HOST:PORT set


@dataclass(frozen=True)
class DiscoveryConfig:
    prefill_dns: tuple[str, ...] = ()  # HOST:PORT names whose A records are prefill nodes
    decode_dns: tuple[str, ...] = ()
    nodes_file: str | None = None  # YAML/JSON {"prefill": [HOST:PORT, ...], "decode": [...]}
    interval_s: float = 5.0  # DNS re-resolution and file check period

    def __post_init__(self) -> None:
        for name in (*self.prefill_dns, *self.decode_dns):
            split_host_port(name)
        if not self.interval_s > 0:
            raise ValueError(f"discovery_interval_s must be > 0, got {self.interval_s}")

    @property
    def is_dynamic(self) -> bool:
        return bool(self.prefill_dns or self.decode_dns or self.nodes_file)


def split_host_port(text: str) -> tuple[str, int]:
    """("host", port) of "host:port"; raises ValueError naming text otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in " /;,"):
        raise ValueError(f"node address must be HOST:PORT, got {text!r}")
    return host, int(port)


def read_nodes_file(path: str) -> Addresses:
    """The file's nodes by kind. YAML (JSON is YAML): a mapping with the keys "prefill" and/or
    "decode", each a list of HOST:PORT. Raises ValueError naming the file for anything else,
    OSError when it cannot be read. An empty file is an error too: a writer that truncates and then
    writes (`echo ... > nodes.yaml`, most editors) shows an empty file for a moment, and reading
    that as "no nodes" would empty the pool; an empty pool is written `{}`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"nodes file {path}: not YAML/JSON: {exc}") from None
    if data is None:
        raise ValueError(f"nodes file {path}: empty (being rewritten?); write {{}} for no nodes")
    if not isinstance(data, dict) or not set(data) <= set(KINDS):
        raise ValueError(f"nodes file {path}: expected a mapping with keys {KINDS}, got {str(data)[:200]!r}")
    nodes = {}
    for kind in KINDS:
        entries = data.get(kind) or []
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError(f"nodes file {path}: {kind} must be a list of HOST:PORT strings")
        for entry in entries:
            split_host_port(entry)
        nodes[kind] = frozenset(e.strip() for e in entries)
    return nodes


async def resolve(name: str) -> frozenset[str]:
    """HOST:PORT for every IPv4/IPv6 address name's host resolves to now (the system resolver:
    /etc/hosts, DNS). Raises OSError (socket.gaierror) when it does not resolve."""
    host, port = split_host_port(name)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return frozenset(_join(info[4][0], port) for info in infos)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback_address(address: str) -> bool:
    """Whether a host:port address is on this machine's loopback interface."""
    return is_loopback_host(address.rpartition(":")[0])


class Discovery:
    """Keeps pool's nodes equal to what the sources list (see the module's doc). start() runs
    it on the running loop; the admin calls (add/remove/drain/nodes) are synchronous and take
    effect at once. may_reach(address) says whether this proxy may dial address (without a
    cluster secret only loopback); a node it may not reach is refused, not added."""

    def __init__(self, pool: NodePool, names: NodeNames, static: Addresses, config: DiscoveryConfig,
                 may_reach: Callable[[str], bool]) -> None:
        self.pool = pool
        self.names = names
        self.config = config
        self.may_reach = may_reach
        empty = {kind: frozenset() for kind in KINDS}
        self._sources: dict[str, Addresses] = {"static": {**empty, **static}, "dns": dict(empty),
                                               "file": dict(empty), "admin": dict(empty)}
        self._dns: dict[str, frozenset[str]] = {}  # name -> its last good resolution
        self._removed: set[tuple[str, str]] = set()  # (kind, address) taken out by the admin
        self._file_stamp: tuple[float, int] | None = None
        self._task: asyncio.Task | None = None
        self._refused_logged: set[str] = set()

    # ---- running ----------------------------------------------------------------------------

    async def start(self) -> None:
        """First refresh now (so DNS/file nodes are in the pool before the first request),
        then every interval in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + self.config.interval_s
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            try:
                if loop.time() >= next_refresh:
                    next_refresh = loop.time() + self.config.interval_s
                    await self.refresh()
                else:
                    self._sweep()
            except Exception:  # noqa: BLE001 - a task edge: log, keep discovering
                logger.exception("node discovery failed; trying again in %.1f s", self.config.interval_s)

    async def refresh(self) -> None:
        """Re-resolve the DNS names, re-read the node file if it changed, and apply the result."""
        await self._resolve_all()
        self._read_file()
        self.reconcile()

    async def _resolve_all(self) -> None:
        for kind, names in (("prefill", self.config.prefill_dns), ("decode", self.config.decode_dns)):
            found: set[str] = set()
            for name in names:
                try:
                    addresses = await resolve(name)
                except OSError as exc:
                    logger.warning("%s DNS %s does not resolve (%s): keeping its last %d nodes", kind, name, exc,
                                   len(self._dns.get(name, ())))
                    addresses = self._dns.get(name, frozenset())
                else:
                    if addresses != self._dns.get(name):
                        logger.info("%s DNS %s resolves to %s", kind, name, ", ".join(sorted(addresses)))
                self._dns[name] = addresses
                found |= addresses
            self._sources["dns"][kind] = frozenset(found)

    def _read_file(self) -> None:
        path = self.config.nodes_file
        if path is None:
            return
        try:
            stat = os.stat(path)
            stamp = (stat.st_mtime, stat.st_size)
            if stamp == self._file_stamp:
                return
            nodes = read_nodes_file(path)
            after = os.stat(path)
            if (after.st_mtime, after.st_size) != stamp:  # changed while read: read it next time
                return
        except (OSError, ValueError) as exc:
            logger.warning("nodes file %s: %s; keeping its last nodes", path, exc)
            return
        self._file_stamp = stamp
        if nodes != {k: self._sources["file"][k] for k in KINDS}:
            logger.info("nodes file %s: %s", path, "; ".join(f"{k} {', '.join(sorted(v)) or '-'}"
                                                            for k, v in nodes.items()))
        self._sources["file"] = nodes

    # ---- the pool follows the sources ----------------------------------------------------------

    def wanted(self) -> set[tuple[str, str]]:
        """(kind, address) of every node some source lists, less those the admin removed."""
        listed = {(kind, a) for source in self._sources.values() for kind, addresses in source.items()
                  for a in addresses}
        return listed - self._removed

    def reconcile(self) -> None:
        """Add the nodes wanted and not in the pool, retire those in it and no longer wanted
        (back in service if wanted again before they left), then remove drained ones."""
        wanted = self.wanted()
        present = {(n.kind, n.address): n for n in self.pool.all}
        for kind, address in sorted(wanted - set(present)):
            self._add_to_pool(kind, address)
        for key, node in present.items():
            if key not in wanted and not node.is_retiring:
                logger.info("%s node %s: no longer listed (or removed by the admin): no new requests, leaving "
                            "once its %d requests end", node.kind, node.address, len(node.queues))
                node.is_retiring = True
            elif key in wanted and node.is_retiring:
                logger.info("%s node %s: listed again, back in service", node.kind, node.address)
                node.is_retiring = False
        self._sweep()

    def _add_to_pool(self, kind: str, address: str) -> NodeClient | None:
        if not self.may_reach(address):
            if address not in self._refused_logged:
                self._refused_logged.add(address)
                logger.error("%s node %s is not loopback and this proxy has no cluster secret: not adding it",
                             kind, address)
            return None
        node = self.pool.add_node(address, kind)
        name = self.names.add(address, kind)
        logger.info("%s node %s joined as %s", kind, address, name)
        return node

    def _sweep(self) -> None:
        """Remove retiring nodes that hold no request of this proxy any more."""
        for node in [n for n in self.pool.all if n.is_retiring and not n.queues]:
            self.pool.remove_node(node)
            logger.info("%s node %s left the pool (drained)", node.kind, node.address)

    # ---- the admin endpoint's calls ----------------------------------------------------------

    def add(self, kind: str, address: str) -> NodeClient:
        """Add a node now (it is routed to once it reports). Raises ValueError for a bad kind or
        address, or one this proxy may not reach."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        split_host_port(address)
        if not self.may_reach(address):
            raise ValueError(f"{address} is not loopback and this proxy has no cluster secret")
        self._removed.discard((kind, address))
        self._sources["admin"][kind] = self._sources["admin"][kind] | {address}
        self.reconcile()
        return self.node(address, kind)

    def remove(self, address: str, kind: str | None = None) -> NodeClient:
        """Take a node out of this proxy's pool: no new requests now, gone once its requests end
        (the node itself goes on running). It stays out even if a source lists it, until
        add() brings it back. Raises KeyError for a node not in the pool."""
        node = self.node(address, kind)
        self._removed.add((node.kind, node.address))
        self._sources["admin"][node.kind] = self._sources["admin"][node.kind] - {node.address}
        self.reconcile()
        return node

    def drain(self, address: str, kind: str | None = None, reason: str = "admin drain") -> NodeClient:
        """Ask the node itself to drain (protocol.Drain: as on SIGTERM it refuses new requests,
        finishes its running ones, then exits); this proxy routes around it at once. Raises
        KeyError for a node not in the pool, NodeDied when it does not take messages."""
        node = self.node(address, kind)
        return self.pool.drain(node.address, reason)

    def node(self, address: str, kind: str | None = None) -> NodeClient:
        """The pool's node at address (of kind, when two kinds share it); raises KeyError."""
        for node in self.pool.all:
            if address in (node.address, self.names.name(node)) and kind in (None, node.kind):
                return node
        raise KeyError(f"no node {address!r} in the pool")

    def describe(self) -> list[dict]:
        """Every node of the pool: name, kind, address, the sources listing it, state, and this
        proxy's requests sent to it and held on it now."""
        return [{"name": self.names.add(n.address, n.kind), "kind": n.kind, "address": n.address,
                 "sources": [s for s in SOURCES if n.address in self._sources[s][n.kind]],
                 "state": _state(n), "requests_sent": n.num_requests_sent, "requests_in_flight": len(n.queues)}
                for n in self.pool.all]


def _state(node: NodeClient) -> str:
    if node.is_retiring:
        return "retiring"
    if node.is_draining:
        return "draining"
    return "ready" if node.is_routable else ("down" if not node.is_healthy else "unavailable")
