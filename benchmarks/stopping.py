"""A benchmark cut off by SIGTERM (a step's timeout in benchmarks/gpu_checks.sh) stops its
servers and writes the results it has on the way out: stop_on_sigterm() turns the signal into
Stopped, which no `except Exception` on the way takes."""

from __future__ import annotations

import signal


class Stopped(BaseException):  # noqa: N818 - not an error
    """SIGTERM came: what runs stops, the results so far are written."""


def _stop(signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup that follows is not cut short
    raise Stopped(f"stopped by signal {signum}")


def stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _stop)
