"""What `pdserve tune` chooses between: a Layout (P:D split of K units, or colocated replicas,
with the nodes' tensor-parallel sizes and batch limits), the candidates for K units, a workload, the SLO, and the
`pdserve up` command line and node/proxy arguments that start a layout."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.protocol import default_of

# NOTE: disaggregated layouts run with the proxy's conditional disaggregation off (a negative
# wait means never): the simulator models pure disaggregation, where a prompt is prefilled only
# on a prefill node; with it on, a backed-up prefill pool sends prompts to decode nodes, which
# is neither of the two modelled setups.
NO_LOCAL_PREFILL = ("--local-prefill-min-wait-s", "-1")


def scheduler_default(name: str) -> int:
    """The node's own default for a SchedulerConfig field."""
    return default_of(SchedulerConfig, name)


@dataclass(frozen=True)
class Layout:
    """One deployment of K units (one core each): num_prefill prefill nodes + num_decode decode
    nodes, or (num_prefill 0) num_decode colocated nodes; each prefill node a tensor-parallel
    group of prefill_tp units, each decode or colocated node one of decode_tp units; every node
    gets the same batch limits (pdserve up passes node flags to all nodes)."""

    num_prefill: int
    num_decode: int
    max_num_seqs: int = scheduler_default("max_num_seqs")
    max_num_batched_tokens: int = scheduler_default("max_num_batched_tokens")
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"tensor-parallel sizes must be >= 1, got {self.prefill_tp} and {self.decode_tp}")
        if self.num_prefill == 0 and self.prefill_tp != 1:
            raise ValueError(f"a colocated layout has no prefill nodes to split, got prefill_tp {self.prefill_tp}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)  # raises ValueError naming the field

    @property
    def is_colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_units(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def tp_sizes(self) -> set[int]:
        """The tensor-parallel sizes its nodes run (the profiles a simulation needs)."""
        return {self.decode_tp} if self.is_colocated else {self.prefill_tp, self.decode_tp}

    @property
    def split_name(self) -> str:
        if self.is_colocated:
            return f"{self.num_decode}x colocated{_tp_tag(self.decode_tp)}"
        return f"{self.num_prefill}P{_tp_tag(self.prefill_tp)}+{self.num_decode}D{_tp_tag(self.decode_tp)}"

    @property
    def name(self) -> str:
        return f"{self.split_name} seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens}"

    @property
    def num_non_default_limits(self) -> int:
        """How many batch limits differ from the node's defaults (ties go to fewer)."""
        return sum(1 for name in ("max_num_seqs", "max_num_batched_tokens")
                   if getattr(self, name) != scheduler_default(name))

    def node_args(self) -> list[str]:
        """Node flags (each node of the layout gets them)."""
        return ["--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens)]

    def proxy_args(self) -> list[str]:
        return [] if self.is_colocated else list(NO_LOCAL_PREFILL)

    def up_command(self, model_dir: str) -> str:
        """The `pdserve up` line that starts this layout."""
        parts = ["pdserve", "up", "--model", model_dir, "--prefill", str(self.num_prefill),
                 "--decode", str(self.num_decode)]
        if self.prefill_tp > 1:
            parts += ["--prefill-tp", str(self.prefill_tp)]
        if self.decode_tp > 1:
            parts += ["--decode-tp", str(self.decode_tp)]
        return " ".join([*parts, *self.node_args(), *self.proxy_args()])


def _tp_tag(size: int) -> str:
    return f"(TP{size})" if size > 1 else ""


def enumerate_layouts(num_units: int, max_num_seqs: list[int], max_num_batched_tokens: list[int],
                      tp_sizes: tuple[int, ...] = (1,)) -> list[Layout]:
    """Every layout using exactly num_units units: pP+dD splits (p, d >= 1) with a
    tensor-parallel size from tp_sizes on each side, and colocated replicas of each size; each
    with every (max_num_seqs, max_num_batched_tokens) pair. Raises ValueError for num_units < 1,
    empty lists, or a size < 1."""
    if num_units < 1:
        raise ValueError(f"units must be >= 1, got {num_units}")
    if not max_num_seqs or not max_num_batched_tokens:
        raise ValueError("need at least one max_num_seqs and one max_num_batched_tokens value")
    if not tp_sizes or min(tp_sizes) < 1:
        raise ValueError(f"tensor-parallel sizes must be >= 1, got {list(tp_sizes)}")
    sizes = sorted(set(tp_sizes))
    splits = [(p, ptp, (num_units - p * ptp) // dtp, dtp) for ptp in sizes for dtp in sizes
              for p in range(1, num_units) if num_units - p * ptp >= dtp and (num_units - p * ptp) % dtp == 0]
    splits += [(0, 1, num_units // tp, tp) for tp in sizes if num_units % tp == 0]
    return [Layout(p, d, seqs, tokens, prefill_tp=ptp, decode_tp=dtp)
            for p, ptp, d, dtp in splits for seqs in max_num_seqs for tokens in max_num_batched_tokens]


@dataclass(frozen=True)
class Workload:
    """Fixed-length random prompts of input_len tokens, output_len output tokens each (ignore_eos),
    Poisson arrivals; rate_max caps the rates searched (None: up to the model's capacity)."""

    input_len: int
    output_len: int
    rate_max: float | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"workload lengths must be >= 1, got {self.input_len}:{self.output_len}")
        if self.rate_max is not None and not (self.rate_max > 0 and math.isfinite(self.rate_max)):
            raise ValueError(f"workload rate_max must be a positive number, got {self.rate_max}")

    @property
    def name(self) -> str:
        tail = f":{self.rate_max:g}" if self.rate_max is not None else ""
        return f"{self.input_len}:{self.output_len}{tail}"

    @classmethod
    def parse(cls, text: str) -> Workload:
        """"1024:128" or "1024:128:0.5" (input_len:output_len[:rate_max]); raises ValueError."""
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"a workload is input_len:output_len[:rate_max], got {text!r}")
        try:
            rate_max = float(parts[2]) if len(parts) == 3 else None
            return cls(int(parts[0]), int(parts[1]), rate_max)
        except ValueError as exc:
            raise ValueError(f"bad workload {text!r}: {exc}") from None


@dataclass(frozen=True)
class Slo:
    """Both targets (seconds) and the share of requests that must meet them."""

    ttft_s: float
    tpot_s: float
    target: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0, got ttft {self.ttft_s} s, tpot {self.tpot_s} s")
        if not 0 < self.target <= 1:
            raise ValueError(f"SLO target share must be in (0, 1], got {self.target}")

    def is_met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s
