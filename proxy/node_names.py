"""The names nodes are shown under to clients (/health, /metrics, error messages): their kind
and position in the configuration ("prefill0", "decode1"), so the API tells nothing of the
cluster's addresses unless the operator allows it (--expose-node-addresses)."""

from __future__ import annotations

import re


class NodeNames:
    """Maps node addresses to public names; with is_exposed, every name is the address."""

    def __init__(self, prefill_addresses: tuple[str, ...], decode_addresses: tuple[str, ...],
                 is_exposed: bool = False) -> None:
        self.is_exposed = is_exposed
        self._names = {address: f"{kind}{idx}" for kind, addresses in (("prefill", prefill_addresses),
                                                                       ("decode", decode_addresses))
                       for idx, address in enumerate(addresses)}
        self._compile()

    def add(self, address: str, kind: str) -> str:
        """Name a node that joined after start (proxy.discovery): the next free "{kind}{n}"; a
        name, once given, stays with its address (a node removed and added again keeps it)."""
        if address not in self._names:
            taken = set(self._names.values())
            self._names[address] = next(f"{kind}{n}" for n in range(len(taken) + 1) if f"{kind}{n}" not in taken)
            self._compile()
        return self._names[address]

    def _compile(self) -> None:
        # Longest first, and not followed by a digit, so 127.0.0.1:80 never matches in 127.0.0.1:8001.
        ordered = sorted(self._names, key=len, reverse=True)
        alternatives = "|".join(map(re.escape, ordered)) or r"(?!)"  # none yet: matches nothing
        self._pattern = re.compile("(?:" + alternatives + r")(?!\d)")

    def name(self, node) -> str:
        """node: anything with an address (a NodeClient)."""
        return node.address if self.is_exposed else self._names.get(node.address, node.kind)

    def redact(self, text: str) -> str:
        """text with each node address replaced by the node's name (unchanged when exposed)."""
        if self.is_exposed:
            return text
        return self._pattern.sub(lambda match: self._names[match.group(0)], text)
