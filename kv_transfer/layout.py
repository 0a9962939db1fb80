"""KVLayout: what two engines must agree on before blocks move between them."""

from __future__ import annotations

import hashlib

import msgspec

from kv_transfer.errors import LayoutMismatch

# Fields that must match; num_blocks may differ (each side sizes its own cache).
_MUST_MATCH = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "model_fingerprint", "code_version")


class KVLayout(msgspec.Struct, frozen=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int
    model_fingerprint: str
    code_version: str
    # The KV heads each tensor-parallel rank's cache holds, [start, stop) of num_kv_heads (its
    # length is the TP degree); empty: one cache holds them all. Peers may differ here: a read
    # moves heads between any two splits (kv_transfer.shards).
    kv_head_ranges: list[tuple[int, int]] = []

    @property
    def block_numel(self) -> int:
        """The elements of one block of every head (a one-rank cache's block)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.kv_head_ranges) or 1


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raises LayoutMismatch naming every differing field with both sides' values."""
    diffs = [f"{name}: local {getattr(local, name)!r}, remote {getattr(remote, name)!r}"
             for name in _MUST_MATCH if getattr(local, name) != getattr(remote, name)]
    if diffs:
        raise LayoutMismatch("KV layouts differ: " + "; ".join(diffs))


def must_match_fields(layout: KVLayout) -> dict[str, str]:
    """The fields two peers must agree on, as text (for reports and messages)."""
    return {name: str(getattr(layout, name)) for name in _MUST_MATCH}


def fingerprint(layout: KVLayout) -> str:
    """A short hash of the fields that must match: equal exactly when check_compatible passes."""
    text = ";".join(f"{name}={value}" for name, value in must_match_fields(layout).items())
    return hashlib.sha256(text.encode()).hexdigest()[:16]
