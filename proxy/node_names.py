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
        # Longest first, and not followed by a digit, so 127.0.0.1:80 never matches in 127.0.0.1:8001.
        ordered = sorted(self._names, key=len, reverse=True)
        self._pattern = re.compile("(?:" + "|".join(map(re.escape, ordered)) + r")(?!\d)")

    def name(self, node) -> str:
        """node: anything with an address (a NodeClient)."""
        return node.address if self.is_exposed else self._names.get(node.address, node.kind)

    def redact(self, text: str) -> str:
        """text with each node address replaced by the node's name (unchanged when exposed)."""
        if self.is_exposed:
            return text
        return self._pattern.sub(lambda match: self._names[match.group(0)], text)
