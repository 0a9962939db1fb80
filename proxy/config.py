"""ProxyConfig: the proxy's settings, built once by `pdserve proxy` and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProxyConfig:
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = field(default_factory=tuple)
    request_timeout_s: float = 600.0
    first_token_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 3.0
    api_key: str | None = None
    max_model_len: int | None = None  # None: from the nodes' load reports (or config.json)

    def __post_init__(self) -> None:
        if not self.decode_addresses:
            raise ValueError("decode_addresses must name at least one decode node")
        for address in (*self.prefill_addresses, *self.decode_addresses):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"node address must be HOST:PORT, got {address!r}")
        for name in ("request_timeout_s", "first_token_timeout_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
