"""SamplingParams: how one request's tokens are chosen and when it stops; validated on creation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.protocol import SamplingOptions

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # the chosen token's logprob plus the top N

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def to_options(self) -> SamplingOptions:
        fields = asdict(self)
        fields["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingOptions(**fields)

    @classmethod
    def from_options(cls, options: SamplingOptions) -> "SamplingParams":
        """Raises ValueError naming the parameter when the options are out of range."""
        fields = {name: getattr(options, name) for name in options.__struct_fields__}
        fields["stop_token_ids"] = tuple(options.stop_token_ids)
        return cls(**fields)


def _problems(p: SamplingParams) -> list[str]:
    checks = [
        (p.max_tokens >= 1, f"max_tokens must be >= 1, got {p.max_tokens}"),
        (p.min_tokens >= 0, f"min_tokens must be >= 0, got {p.min_tokens}"),
        (p.min_tokens <= p.max_tokens,
         f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})"),
        (p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= 0, f"top_k must be >= 0 (0 or -1 disables it), got {p.top_k}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (-2.0 <= p.presence_penalty <= 2.0,
         f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0,
         f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (p.repetition_penalty > 0.0,
         f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
         f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}"),
        (all(t >= 0 for t in p.stop_token_ids),
         f"stop_token_ids must be non-negative, got {list(p.stop_token_ids)}"),
    ]
    return [message for ok, message in checks if not ok]
