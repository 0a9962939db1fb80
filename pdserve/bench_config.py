"""Settings of `pdserve bench`: one frozen dataclass per concern (endpoint, dataset, load, SLOs),
composed by BenchConfig. Each default lives here once; the command line reads it from the fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ENDPOINTS = ("completions", "chat")
DATASETS = ("random", "jsonl", "sharegpt", "multiturn")
ARRIVALS = ("poisson", "constant", "gamma")


@dataclass(frozen=True)
class EndpointConfig:
    """Where requests go and how they are asked for."""

    base_url: str = "http://127.0.0.1:8000"  # without /v1
    model: str | None = None  # None: the endpoint's first model (GET /v1/models)
    endpoint: str = "completions"  # completions: /v1/completions; chat: /v1/chat/completions
    is_stream: bool = True
    temperature: float = 0.0
    # Log probabilities asked for each token (completions "logprobs", chat "top_logprobs"); None:
    # none. Every token then arrives in a chunk of its own, even one without text (a random-weight
    # model's special tokens), which otherwise sends none and shifts TTFT and ITL to later tokens.
    logprobs: int | None = None
    api_key: str | None = None
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")


@dataclass(frozen=True)
class DatasetConfig:
    """What is asked: prompts and output lengths (see pdserve.bench_datasets)."""

    name: str = "random"
    path: str | None = None  # the jsonl or ShareGPT file
    num_requests: int = 64  # multiturn: num_users x turns unless num_users is set
    input_len: int = 256  # random: prompt tokens; multiturn: words per user message
    input_len_range: str | None = None  # "R": uniform in [L(1-R), L(1+R)]; "LOW:HIGH": uniform in [LOW, HIGH]
    output_len: int = 64  # max_tokens (jsonl: where a line has none)
    output_len_range: str | None = None
    sharegpt_output_len: int | None = None  # None: the length of the conversation's answer
    ignore_eos: bool | None = None  # None: on for random, off for the others
    vocab_low: int = 8  # random token-id prompts draw ids in [vocab_low, vocab_high)
    vocab_high: int = 2000
    system_prompt_len: int = 64  # multiturn: words of the system prompt all users share
    turns: int = 3  # multiturn: turns per user
    num_users: int | None = None  # multiturn: None: num_requests // turns
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.name!r}")
        if self.name in ("jsonl", "sharegpt") and not self.path:
            raise ValueError(f"dataset {self.name!r} needs a dataset path")
        for name in ("num_requests", "input_len", "output_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_users is not None and self.num_users < 1:
            raise ValueError(f"num_users must be >= 1, got {self.num_users}")
        if self.system_prompt_len < 0:
            raise ValueError(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(f"need 0 <= vocab_low < vocab_high, got {self.vocab_low}, {self.vocab_high}")
        length_bounds(self.input_len, self.input_len_range)  # raises ValueError when malformed
        length_bounds(self.output_len, self.output_len_range)

    @property
    def is_ignore_eos(self) -> bool:
        return self.name == "random" if self.ignore_eos is None else self.ignore_eos


def length_bounds(length: int, spec: str | None) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: (length, length) without a spec; for a ratio R
    [floor(L(1-R)), ceil(L(1+R))] as vLLM's --random-range-ratio; for "LOW:HIGH" those. Raises
    ValueError for a malformed spec."""
    if spec is None:
        return length, length
    if ":" in spec:
        low_text, high_text = spec.split(":", 1)
        low, high = int(low_text), int(high_text)
    else:
        ratio = float(spec)
        if not 0 <= ratio < 1:
            raise ValueError(f"a length range ratio must be in [0, 1), got {spec!r}")
        low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    if not 1 <= low <= high:
        raise ValueError(f"a length range needs 1 <= low <= high, got {spec!r} -> [{low}, {high}]")
    return low, high


@dataclass(frozen=True)
class LoadConfig:
    """When requests are sent."""

    request_rate: float = math.inf  # requests (multiturn: users) per second; inf: all at once
    arrival: str = "poisson"  # gaps: poisson (exponential), constant (1/rate), gamma (shape = burstiness)
    burstiness: float = 1.0  # gamma shape; 1.0 is Poisson, < 1 burstier, > 1 more even (vLLM's)
    max_concurrency: int | None = None  # None: no limit
    num_warmup_requests: int = 0
    seed: int = 0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            raise ValueError(f"burstiness {self.burstiness} needs arrival 'gamma' (poisson is burstiness 1.0)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmup_requests < 0:
            raise ValueError(f"num_warmup_requests must be >= 0, got {self.num_warmup_requests}")


@dataclass(frozen=True)
class SloConfig:
    """Latency targets; a request meets the SLO when it succeeded and meets every target set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    target: float = 0.9  # a sweep's goodput rate: the highest rate with attainment >= target

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"slo {name} must be > 0, got {value}")
        if not 0 < self.target <= 1:
            raise ValueError(f"slo target must be in (0, 1], got {self.target}")

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


@dataclass(frozen=True)
class BenchConfig:
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    slo: SloConfig = field(default_factory=SloConfig)
