"""`pdserve tune`, part 1: time an LLMEngine in this process on one unit's cores (prefill steps by
prompt length and batch tokens, decode steps by batch size and context, one mixed step as a check,
a KV copy) and fit the linear step-time models the simulator (tune_sim) runs on."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.kv_cache import block_size_bytes, num_cache_blocks
from engine.protocol import Role, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tp_shard import check_tensor_parallel
from engine.warm_up import warm_up

# NOTE: a NIXL (UCX) pull of a prompt's layer-major blocks into scattered ones, as a fixed cost
# (the messages around it, the descriptors) plus the bytes at a share of an in-process copy's
# speed: 10 ms + 0.55 x copy fits 512 to 8,192 tokens of the small preset within 5%
# (benchmarks/kv_transfer.py; docs/benchmarks.md, KV transfer).
NIXL_COPY_RATIO = 0.55
TRANSFER_FIXED_S = 0.010

PREFILL_FEATURES = ("fixed_s", "per_token_s", "per_attention_pair_s")
DECODE_FEATURES = ("fixed_s", "per_seq_s", "per_context_token_s")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LinearModel:
    """seconds = sum(coefs[i] * features[i]); max_rel_error is the worst |fit - measured| /
    measured over the points it was fitted on."""

    names: tuple[str, ...]
    coefs: tuple[float, ...]
    max_rel_error: float = 0.0

    def predict(self, features: Sequence[float]) -> float:
        return sum(c * f for c, f in zip(self.coefs, features))

    def to_json(self) -> dict:
        return {**dict(zip(self.names, self.coefs)), "max_rel_error": self.max_rel_error}


def fit_linear(rows: Sequence[Sequence[float]], targets: Sequence[float], names: Sequence[str]) -> LinearModel:
    """Least squares on relative errors (each point weighted by 1 / its time, so a 100 ms point
    counts as much as a 4 s one and pins the fixed cost), with no negative coefficient: a feature
    whose coefficient comes out < 0 (noise on a term too small to see) is dropped and the rest
    refitted. Columns are scaled to [0, 1] first (per-token and per-pair costs differ by orders of
    magnitude). Raises ValueError with fewer points than features or a time <= 0."""
    x, y = np.asarray(rows, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < x.shape[1] or x.shape[1] != len(names):
        raise ValueError(f"fit_linear needs >= {len(names)} points of {len(names)} features, got shape {x.shape}")
    if not (y > 0).all():
        raise ValueError(f"fit_linear needs positive times, got {y.tolist()}")
    weighted = x / y[:, None]
    kept = list(range(x.shape[1]))
    while True:
        scale = np.maximum(np.abs(weighted[:, kept]).max(axis=0), 1e-30)
        solved, *_ = np.linalg.lstsq(weighted[:, kept] / scale, np.ones_like(y), rcond=None)
        coefs = solved / scale
        if (coefs >= 0).all() or len(kept) == 1:
            break
        kept.pop(int(np.argmin(solved)))
    full = np.zeros(x.shape[1])
    full[kept] = np.maximum(coefs, 0.0)
    fitted = x @ full
    max_rel_error = float(np.max(np.abs(fitted - y) / np.maximum(y, 1e-12)))
    return LinearModel(tuple(names), tuple(float(c) for c in full), max_rel_error)


def attention_pairs(num_new: int, num_computed: int) -> int:
    """(query, key) pairs of a prefill chunk of num_new tokens after num_computed: token i of the
    chunk attends to num_computed + i keys."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class Profile:
    """Step-time models of one unit and the KV transfer: what the simulator needs."""

    model_name: str
    num_threads: int
    prefill: LinearModel  # one prefill-only step: PREFILL_FEATURES of (1, tokens, attention pairs)
    decode: LinearModel  # one decode-only step: DECODE_FEATURES of (1, sequences, context tokens)
    kv_bytes_per_token: int
    copy_bytes_per_s: float  # an in-process copy of KV blocks, measured
    kv_capacity_tokens: int  # a node's cache at its default budget (sized from free memory now)
    mixed_check: dict | None = None  # one measured mixed step beside step_s
    # Requests alone on one served node (HTTP, proxy, node loop) beside their simulation, and the
    # per-step cost added for what the in-process timing leaves out (tune.calibrated); None: not done.
    served_check: dict | None = None
    # A step's time while another unit computes, over its time alone (shared caches, memory
    # bandwidth and clocks); the simulation applies it while another node is busy. 1.0: not measured.
    contention: float = 1.0
    points: list[dict] = field(default_factory=list)
    tensor_parallel_size: int = 1  # a node of this many ranks, num_threads cores each

    def step_s(self, num_decodes: int, num_context_tokens: int, num_prefill_tokens: int, num_pairs: int) -> float:
        """One engine step: the prefill and decode parts add, with one fixed cost (the larger of
        the two present: one pass over the weights serves both)."""
        fixed, total = 0.0, 0.0
        if num_prefill_tokens:
            p = self.prefill.coefs
            fixed, total = p[0], p[1] * num_prefill_tokens + p[2] * num_pairs
        if num_decodes:
            d = self.decode.coefs
            fixed = max(fixed, d[0])
            total += d[1] * num_decodes + d[2] * num_context_tokens
        return fixed + total

    def prefill_s(self, num_tokens: int) -> float:
        return self.step_s(0, 0, num_tokens, attention_pairs(num_tokens, 0))

    def transfer_s(self, num_tokens: int) -> float:
        """A decode node's pull of one prompt's KV: TRANSFER_FIXED_S + the bytes at NIXL's share
        of the measured copy speed."""
        return TRANSFER_FIXED_S + num_tokens * self.kv_bytes_per_token / (self.copy_bytes_per_s * NIXL_COPY_RATIO)

    def with_fixed_extra(self, prefill_s: float, decode_s: float) -> Profile:
        """This profile with prefill_s added to a prefill step's fixed time and decode_s to a
        decode step's (each kept >= 0): the deployment's own per-step cost."""
        def plus(model: LinearModel, extra_s: float) -> LinearModel:
            return replace(model, coefs=(max(0.0, model.coefs[0] + extra_s), *model.coefs[1:]))
        return replace(self, prefill=plus(self.prefill, prefill_s), decode=plus(self.decode, decode_s))

    def with_per_seq_extra(self, extra_s: float) -> Profile:
        """This profile with extra_s added to a decode step's cost per sequence (kept >= 0): the
        serving stack's own per-token work, which grows with the batch."""
        d = self.decode.coefs
        return replace(self, decode=replace(self.decode, coefs=(d[0], max(0.0, d[1] + extra_s), *d[2:])))

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        """The inverse of to_json; raises KeyError / ValueError for a malformed record."""
        def model(fields: dict, names: tuple[str, ...]) -> LinearModel:
            return LinearModel(names, tuple(float(fields[n]) for n in names), float(fields["max_rel_error"]))

        return cls(data["model"], int(data["num_threads"]), model(data["prefill"], PREFILL_FEATURES),
                   model(data["decode"], DECODE_FEATURES), int(data["kv_bytes_per_token"]),
                   float(data["copy_bytes_per_s"]), int(data["kv_capacity_tokens"]), data.get("mixed_check"),
                   served_check=data.get("served_check"), points=list(data.get("points", [])),
                   contention=float(data.get("contention", 1.0)),
                   tensor_parallel_size=int(data.get("tensor_parallel_size", 1)))

    def to_json(self) -> dict:
        return {"model": self.model_name, "num_threads": self.num_threads, "prefill": self.prefill.to_json(),
                "decode": self.decode.to_json(), "kv_bytes_per_token": self.kv_bytes_per_token,
                "copy_bytes_per_s": self.copy_bytes_per_s, "kv_capacity_tokens": self.kv_capacity_tokens,
                "mixed_check": self.mixed_check, "points": self.points, "served_check": self.served_check,
                "contention": self.contention, "tensor_parallel_size": self.tensor_parallel_size}


@dataclass(frozen=True)
class Profiles:
    """A Profile per tensor-parallel size profiled, keyed by it: what a layout's nodes run on."""

    by_tp: dict[int, Profile]

    def __post_init__(self) -> None:
        if not self.by_tp:
            raise ValueError("no profile")
        for size, profile in self.by_tp.items():
            if profile.tensor_parallel_size != size:
                raise ValueError(f"the profile of {profile.tensor_parallel_size} ranks is filed under {size}")

    @classmethod
    def of(cls, profile: Profile | Profiles) -> Profiles:
        return profile if isinstance(profile, Profiles) else cls({profile.tensor_parallel_size: profile})

    @property
    def base(self) -> Profile:
        """The smallest size's (one rank's, where profiled)."""
        return self.by_tp[min(self.by_tp)]

    def __getitem__(self, size: int) -> Profile:
        if size not in self.by_tp:
            raise ValueError(f"no profile of a {size}-rank tensor-parallel node (profiled: {sorted(self.by_tp)})")
        return self.by_tp[size]

    def to_json(self) -> dict:
        return {"profiles": [self.by_tp[size].to_json() for size in sorted(self.by_tp)]}

    @classmethod
    def from_json(cls, data: dict) -> Profiles:
        """The inverse of to_json; a single Profile's record (as saved before tensor-parallel
        sizes were profiled) reads as that one profile."""
        records = data.get("profiles", [data])
        profiles = [Profile.from_json(record) for record in records]
        return cls({p.tensor_parallel_size: p for p in profiles})


@dataclass(frozen=True)
class ProfilePlan:
    """Which points to time: prompt lengths up to max_prompt_len (alone, and as batches of
    equal total), decode batches up to max_batch at a short and the longest context."""

    max_prompt_len: int
    max_context_len: int
    max_batch: int = 16
    num_decode_steps: int = 3  # timed steps per decode point (median), after one untimed
    num_prefill_repeats: int = 2  # per prefill point; the fastest counts (others' load only slows)
    budget_s: float = 120.0  # the prefill points stop once the next would overrun this

    def prefill_batches(self) -> list[list[int]]:
        top = self.max_prompt_len
        singles = sorted({max(1, top >> shift) for shift in range(3, -1, -1)})
        batched = [[max(1, top // 2)] * 2, [max(1, top // 4)] * 4]
        return [[n] for n in singles] + batched

    def decode_points(self) -> list[tuple[int, int]]:
        short = max(1, min(self.max_context_len, 128))
        batches = sorted({1, max(1, self.max_batch // 4), self.max_batch})
        return [(b, c) for c in sorted({short, self.max_context_len}) for b in batches]


@contextlib.contextmanager
def one_unit(num_threads: int) -> Iterator[None]:
    """Run this process on num_threads of its cores with that many torch threads (as a node
    pinned by the launcher), restoring both afterwards."""
    cores = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, set(cores[-num_threads:]))
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(threads)


def profile_model(model_dir: str, plan: ProfilePlan, num_threads: int = 1,
                  progress: Progress = lambda _: None, tensor_parallel_size: int = 1) -> Profile:
    """Time plan's points on num_threads cores per rank of an engine of tensor_parallel_size
    ranks and fit the models; blocks (seconds to minutes, bounded by plan.budget_s for the
    prefill part). Raises ValueError when too few points fit the budget, the model cannot hold
    them or cannot be split that way."""
    model = ModelConfig.from_pretrained(model_dir)
    if plan.max_context_len + 1 > model.max_model_len:
        raise ValueError(f"context {plan.max_context_len} exceeds the model's max_model_len {model.max_model_len}")
    check_tensor_parallel(model, tensor_parallel_size)
    num_cores = num_threads * tensor_parallel_size
    others = sorted(os.sched_getaffinity(0))[:-num_cores]  # the cores one_unit leaves to the other units
    with one_unit(num_cores):
        prefill_points = _profile_prefill(model, plan, progress, tensor_parallel_size)
        prefill = _fit_prefill(prefill_points)
        decode_points, mixed, copy_bytes_per_s, contention = _profile_decode(model, plan, progress, others,
                                                                             tensor_parallel_size)
    decode = fit_linear([p["features"] for p in decode_points], [p["seconds"] for p in decode_points], DECODE_FEATURES)
    kv_bytes = block_size_bytes(model, CacheConfig().block_size) // CacheConfig().block_size
    capacity = num_cache_blocks(model, CacheConfig(), "cpu") * CacheConfig().block_size
    profile = Profile(model.name, num_threads, prefill, decode, kv_bytes, copy_bytes_per_s, capacity,
                      points=prefill_points + decode_points, contention=contention,
                      tensor_parallel_size=tensor_parallel_size)
    return _with_mixed_check(profile, mixed)


def _fit_prefill(points: list[dict]) -> LinearModel:
    if len(points) < len(PREFILL_FEATURES):
        raise ValueError(f"only {len(points)} prefill points fit the profiling budget; raise --max-minutes")
    return fit_linear([p["features"] for p in points], [p["seconds"] for p in points], PREFILL_FEATURES)


def _engine(model: ModelConfig, role: Role, num_blocks: int, max_num_batched_tokens: int,
            tensor_parallel_size: int) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=max_num_batched_tokens)
    return LLMEngine(EngineConfig(model, CacheConfig(num_blocks=num_blocks), scheduler, role=role,
                                  tensor_parallel_size=tensor_parallel_size))


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # NOTE: fresh random ids per point, so no point could reuse another's KV.
    return [rng.randrange(8, max(9, min(vocab_size, 2000))) for _ in range(length)]


def _profile_prefill(model: ModelConfig, plan: ProfilePlan, progress: Progress,
                     tensor_parallel_size: int) -> list[dict]:
    batches = plan.prefill_batches()
    max_tokens = max(sum(b) for b in batches)
    block_size = CacheConfig().block_size
    num_blocks = max(sum(math.ceil(n / block_size) for n in b) for b in batches) + 2
    with _closing(_engine(model, Role.PREFILL, num_blocks, max_tokens, tensor_parallel_size)) as engine:
        warm_up(engine, min(256, plan.max_prompt_len))
        rng, points, started = random.Random(0), [], time.perf_counter()
        for batch in batches:
            expected_s = _predicted_prefill_s(points, sum(batch)) * plan.num_prefill_repeats if points else 0.0
            if expected_s > plan.budget_s - (time.perf_counter() - started):
                progress(f"profile: skipping prefill {batch}: over the profiling budget")
                continue
            seconds = min(_time_prefill(engine, batch, rng, model.vocab_size) for _ in range(plan.num_prefill_repeats))
            pairs = sum(attention_pairs(n, 0) for n in batch)
            points.append({"kind": "prefill", "prompt_lens": batch, "features": [1.0, sum(batch), pairs],
                           "seconds": seconds})
            progress(f"profile: prefill {tp_prefix(tensor_parallel_size)}{len(batch)} x {batch[0]} tokens: "
                     f"{1000 * seconds:.1f} ms")
    return points


@contextlib.contextmanager
def _closing(engine: LLMEngine) -> Iterator[LLMEngine]:
    """The engine, closed (its other ranks stopped) and its memory given back on the way out."""
    try:
        yield engine
    finally:
        engine.close()
        del engine
        gc.collect()


def tp_prefix(size: int) -> str:
    """A progress line's prefix: 'TP2 ' for a tensor-parallel size above 1, nothing for one rank."""
    return f"TP{size} " if size > 1 else ""


def _predicted_prefill_s(points: list[dict], num_tokens: int) -> float:
    """A rough guess (tokens/s of the largest point so far) to keep within the budget."""
    last = max(points, key=lambda p: p["features"][1])
    return last["seconds"] * num_tokens / last["features"][1]


def _time_prefill(engine: LLMEngine, batch: list[int], rng: random.Random, vocab_size: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for idx, length in enumerate(batch):
        engine.add_request(f"profile-prefill-{time.monotonic_ns()}-{idx}", _prompt(rng, length, vocab_size), params)
    started = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - started
    assert len(outputs) == len(batch) and not engine.has_unfinished(), f"prefill {batch} took more than one step"
    for output in outputs:
        engine.free_blocks(output.block_ids)
    return seconds


def _profile_decode(model: ModelConfig, plan: ProfilePlan, progress: Progress, others: list[int],
                    tensor_parallel_size: int) -> tuple[list[dict], dict, float, float]:
    """Decode points (requests joined with blocks already holding their context: the KV's
    values do not change the time), one mixed step, and the copy speed of a prompt's blocks."""
    block_size = CacheConfig().block_size
    per_request = math.ceil((plan.max_context_len + plan.num_decode_steps + 2) / block_size)
    mixed_prompt = max(1, plan.max_prompt_len // 2)
    num_blocks = plan.max_batch * per_request + math.ceil(mixed_prompt / block_size) + 4
    tag = tp_prefix(tensor_parallel_size)
    with _closing(_engine(model, Role.DECODE, num_blocks, max(2048, mixed_prompt + plan.max_batch),
                          tensor_parallel_size)) as engine:
        warm_up(engine, min(128, plan.max_prompt_len))
        rng, points = random.Random(1), []
        for num_seqs, context_len in plan.decode_points():
            seconds, num_context = _time_decode(engine, num_seqs, context_len, plan.num_decode_steps, rng)
            points.append({"kind": "decode", "num_seqs": num_seqs, "context_len": context_len,
                           "features": [1.0, num_seqs, num_context], "seconds": seconds})
            progress(f"profile: decode {tag}{num_seqs} x {context_len} context: {1000 * seconds:.1f} ms/step")
        mixed = _time_mixed(engine, max(1, plan.max_batch // 4), plan.max_context_len, mixed_prompt, rng)
        progress(f"profile: mixed step {tag}({mixed['num_seqs']} decodes + {mixed_prompt} prompt tokens): "
                 f"{1000 * mixed['seconds']:.1f} ms")
        copy_bytes_per_s = _copy_speed(engine, min(plan.max_prompt_len, plan.max_context_len), block_size)
        contention = _contention(engine, max(1, plan.max_batch // 4), plan.max_context_len, rng, others, progress)
    return points, mixed, copy_bytes_per_s, contention


# NOTE: what a busy neighbour does: float32 matmuls of a prefill's shape, on the cores this
# process is not using, until its stdin closes.
_NEIGHBOUR = """
import os, sys, threading, torch
os.sched_setaffinity(0, {cores})
torch.set_num_threads({num_threads})
a, b = torch.randn(256, 2048), torch.randn(2048, 2048)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("ready", flush=True)
while not done.is_set():
    a @ b
"""


def _contention(engine: LLMEngine, num_seqs: int, context_len: int, rng: random.Random, others: list[int],
                progress: Progress) -> float:
    """Decode step time with the machine's other cores computing, over its time alone (median
    of 5 steps each) on others, the cores one_unit left out; 1.0 when there are none."""
    if not others:
        return 1.0
    alone = _time_decode(engine, num_seqs, context_len, 5, rng)[0]
    code = _NEIGHBOUR.format(cores=set(others), num_threads=len(others))
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as neighbour:
        try:
            if neighbour.stdout.readline().strip() != "ready":
                raise OSError("the contention neighbour did not start")
            busy = _time_decode(engine, num_seqs, context_len, 5, rng)[0]
        finally:
            neighbour.stdin.close()
            try:
                neighbour.wait(timeout=30)
            except subprocess.TimeoutExpired:
                neighbour.kill()
    factor = max(1.0, busy / alone)
    progress(f"profile: decode {num_seqs} x {context_len} with the other cores busy: {1000 * busy:.1f} ms/step "
             f"against {1000 * alone:.1f} alone (x{factor:.3f} while another unit computes)")
    return factor


def _join(engine: LLMEngine, num_seqs: int, context_len: int, rng: random.Random, tag: str) -> None:
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    block_size = engine.block_size
    for idx in range(num_seqs):
        block_ids = engine.block_pool.allocate(math.ceil(context_len / block_size))
        assert block_ids is not None, f"profile cache too small for {num_seqs} x {context_len}"
        engine.add_prefilled_request(f"profile-{tag}-{time.monotonic_ns()}-{idx}",
                                     _prompt(rng, context_len, engine.config.model.vocab_size), params,
                                     TokenLogprob(rng.randrange(8, 100)), block_ids)


def _abort_all(engine: LLMEngine) -> None:
    for request_id in engine.request_ids():
        engine.abort(request_id)
    engine.check_leaks()


def _time_decode(engine: LLMEngine, num_seqs: int, context_len: int, num_steps: int,
                 rng: random.Random) -> tuple[float, float]:
    """Median seconds of a decode step and the context tokens the timed steps attended to."""
    _join(engine, num_seqs, context_len, rng, "decode")
    engine.step()  # untimed: the first step of a new batch shape
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    _abort_all(engine)
    # NOTE: step k (from 0) attends to context_len + 1 + k tokens per sequence; this is the middle.
    return statistics.median(times), num_seqs * (context_len + 2 + num_steps / 2)


def _time_mixed(engine: LLMEngine, num_seqs: int, context_len: int, prompt_len: int, rng: random.Random) -> dict:
    _join(engine, num_seqs, context_len, rng, "mixed")
    engine.step()
    engine.add_request(f"profile-mixed-{time.monotonic_ns()}", _prompt(rng, prompt_len, engine.config.model.vocab_size),
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    _abort_all(engine)
    return {"num_seqs": num_seqs, "num_context_tokens": num_seqs * (context_len + 2), "prompt_len": prompt_len,
            "seconds": seconds}


def _copy_speed(engine: LLMEngine, num_tokens: int, block_size: int) -> float:
    """Bytes/s of copying num_tokens' blocks out of the cache and into other blocks (best of 3)."""
    num = max(1, min(math.ceil(num_tokens / block_size), engine.block_pool.num_blocks // 2))
    cache = engine.kv_cache
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        cache[num : 2 * num].copy_(cache[:num])
        best = min(best, time.perf_counter() - started)
    return num * cache[0].numel() * cache.element_size() / best


def _with_mixed_check(profile: Profile, mixed: dict) -> Profile:
    predicted = profile.step_s(mixed["num_seqs"], mixed["num_context_tokens"], mixed["prompt_len"],
                               attention_pairs(mixed["prompt_len"], 0))
    check = {**mixed, "predicted_s": predicted, "rel_error": (predicted - mixed["seconds"]) / mixed["seconds"]}
    return replace(profile, mixed_check=check)
