"""SamplingParams: how one request's tokens are chosen and when it stops; validated on creation.

The fields, their defaults and their ranges are the wire's (engine.protocol.SamplingOptions and
check_sampling), so the proxy and the engine accept exactly the same requests.
"""

from __future__ import annotations

import msgspec

from engine.protocol import SamplingOptions
from engine.sampling_rules import check_sampling


class SamplingParams(SamplingOptions, frozen=True):
    """SamplingOptions checked at construction: raises SamplingError (a ValueError) naming the
    parameter out of range."""

    def __post_init__(self) -> None:
        check_sampling(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_options(cls, options: SamplingOptions) -> SamplingParams:
        """Raises SamplingError naming the parameter when the options are out of range."""
        return cls(**msgspec.structs.asdict(options))
