"""TransferConfig: how a node moves KV blocks (backend, side channel, timeouts)."""

from __future__ import annotations

from dataclasses import dataclass

# "fake": kv_transfer.fake.FakeConnector, in-process, for node tests.
BACKENDS = ("nixl", "gloo", "fake")


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "nixl"
    host: str = "127.0.0.1"  # the side channel binds here and peers reach it here
    side_channel_port: int = 0  # 0: pick a free port
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    lease_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.host:
            raise ValueError(f"host must be set, got {self.host!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port must be in [0, 65536), got {self.side_channel_port}")
        for name in ("handshake_timeout_s", "transfer_timeout_s", "lease_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
