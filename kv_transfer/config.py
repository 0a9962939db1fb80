"""TransferConfig: how a node moves KV blocks (backend, side channel, timeouts, keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.security import CurveKeys, check_bind_host, is_wildcard

# "fake": kv_transfer.fake.FakeConnector, in-process, for node tests.
BACKENDS = ("nixl", "gloo", "fake")
# TransferConfig.device_copy: from a peer on this GPU or another GPU of this host, on this GPU only, never.
DEVICE_COPY_MODES = ("auto", "same-gpu", "off")


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "nixl"
    host: str = "127.0.0.1"  # the side channel binds here (0.0.0.0: every interface)
    # What peers are told to dial (KVHandle.agent_address, the gloo store, the interface UCX
    # uses); "": host, which must then be a concrete address (not a wildcard).
    advertise_host: str = ""
    side_channel_port: int = 0  # 0: pick a free port
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    lease_timeout_s: float = 60.0
    # The cluster's CURVE keys (engine.protocol.curve_keys): the side channel then talks only to
    # holders of the cluster secret. None: no secret, and host must be loopback.
    curve_keys: CurveKeys | None = field(default=None, repr=False)
    # NIXL between two nodes of one host with their caches on GPUs: the blocks as device copies over
    # CUDA IPC (kv_transfer.cuda_ipc) instead of through UCX. "auto": from a peer on this GPU, or on
    # another GPU of this host once a probe copied from there reads back equal; "same-gpu": from a
    # peer on this GPU only; "off": every read through UCX.
    device_copy: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device_copy not in DEVICE_COPY_MODES:
            raise ValueError(f"device_copy must be one of {DEVICE_COPY_MODES}, got {self.device_copy!r}")
        if not self.host:
            raise ValueError(f"host must be set, got {self.host!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port must be in [0, 65536), got {self.side_channel_port}")
        for name in ("handshake_timeout_s", "transfer_timeout_s", "lease_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backend != "fake":
            check_bind_host(self.host, self.curve_keys, "KV side channel")
        if is_wildcard(self.advertise_host):
            raise ValueError(f"advertise_host must be an address peers can dial, got {self.advertise_host!r}")

    @property
    def public_host(self) -> str:
        """The address peers reach this node's side channel (and NIXL agent, gloo store) at."""
        return self.advertise_host or self.host
