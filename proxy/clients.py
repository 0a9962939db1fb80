"""Who a request comes from, and per-client counts held against a cap, so that one client past its
share is refused while the others go on."""

from __future__ import annotations

from starlette.requests import HTTPConnection


def client_id(request: HTTPConnection) -> str:
    """The client a request counts against: its peer address.
    NOTE: not the API key: with one --api-key every client holds the same key, so a hostile
    holder would exhaust the cap of them all; a per-tenant key would be the better identity."""
    return request.client.host if request.client is not None else "unknown"


class ClientCounts:
    """How much each client holds (uploads, request slots); a client holding nothing has no entry."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit  # None: no cap
        self._held: dict[str, int] = {}

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    def can_take(self, client: str, num: int) -> bool:
        return self.limit is None or self.held(client) + num <= self.limit

    def take(self, client: str, num: int) -> None:
        """Count num more for client (the caller checked can_take)."""
        self._held[client] = self.held(client) + num

    def free(self, client: str, num: int) -> None:
        left = self.held(client) - num
        assert left >= 0, f"client {client} freed {num}, held {left + num}"
        if left:
            self._held[client] = left
        else:
            self._held.pop(client, None)

    @property
    def num_clients(self) -> int:
        return len(self._held)

    @property
    def num_held(self) -> int:
        return sum(self._held.values())
