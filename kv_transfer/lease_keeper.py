"""LeaseKeeper: a reader's renewals of the remote leases it holds, sent from a thread of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.base import RemoteLease
from kv_transfer.messages import LeaseRef, RenewLeases
from kv_transfer.security import CurveKeys
from kv_transfer.side_channel import Notifier

# NOTE: how often the thread looks for leases due (each is renewed every lease_timeout_s / 3):
# 10 wake-ups a second cost nothing measurable on an idle node.
_TICK_S = 0.1


@dataclass
class _Held:
    lease: RemoteLease
    renewed_at: float | None = None  # None: due at once


class LeaseKeeper:
    """Renews each held lease every lease_timeout_s / 3 (the first time at once), grouped into
    one RenewLeases per holder, from its own thread: the reader's loop may be inside a model
    step longer than a lease. hold() and drop() are thread-safe and never block."""

    def __init__(self, keys: CurveKeys | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._notifier = Notifier(keys)  # NOTE: used by the thread alone (ZMQ sockets are not thread-safe)
        self._is_stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-lease-keeper", daemon=True)
        self._thread.start()
        self.num_renewals_sent = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, request_id: str, lease: RemoteLease) -> None:
        with self._lock:
            self._held[request_id] = _Held(lease)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._held.pop(request_id, None)

    def close(self) -> None:
        self._is_stopping.set()
        self._thread.join(timeout=2)
        self._notifier.close()

    def _run(self) -> None:
        while not self._is_stopping.wait(_TICK_S):
            for (address, engine_id), refs in self._due().items():
                self._notifier.send(address, RenewLeases(engine_id, refs))
                self.num_renewals_sent += len(refs)

    def _due(self) -> dict[tuple[str, str], list[LeaseRef]]:
        now = self._clock()
        due: dict[tuple[str, str], list[LeaseRef]] = {}
        with self._lock:
            for request_id, held in self._held.items():
                lease = held.lease
                if held.renewed_at is None or now - held.renewed_at >= lease.lease_timeout_s / 3:
                    held.renewed_at = now
                    due.setdefault((lease.address, lease.engine_id), []).append(LeaseRef(request_id, lease.generation))
        return due
