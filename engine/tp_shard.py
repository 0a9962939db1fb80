"""Which part of the model each tensor-parallel rank holds: its attention heads (whole GQA groups,
KV heads replicated where there are fewer than ranks), its slice of the MLP, its slice of the
vocabulary (embedding and LM head)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank rank of size: the query heads q_heads, the KV heads kv_heads (a replicated KV head
    is held by every rank that shares it), the MLP's intermediate rows, the vocabulary rows of
    the embedding and the LM head (vocab_rows: the largest rank's count, which every rank's
    logits are padded to for the gather). Ranges are of the whole model's indices."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_rows: int

    @property
    def is_sharded(self) -> bool:
        return self.size > 1


def check_tensor_parallel(model: ModelConfig, size: int) -> None:
    """Raises ValueError (one line, naming the numbers) unless model splits over size ranks:
    every rank needs one query head at least, whole GQA groups where the KV heads are as many as
    the ranks or more, and a whole share of each KV head's group where they are fewer."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    heads, kv_heads = model.num_heads, model.num_kv_heads
    if size > heads:
        raise ValueError(f"tensor_parallel_size {size} is more than the model's {heads} attention heads")
    if kv_heads < size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must be a multiple of the model's {kv_heads} KV heads "
                         f"(or at most {kv_heads}) to replicate them evenly")
    if (size - 1) * -(-model.vocab_size // size) >= model.vocab_size:
        raise ValueError(f"tensor_parallel_size {size} leaves a rank none of the model's {model.vocab_size} tokens")
    if size > model.intermediate_size:
        raise ValueError(f"tensor_parallel_size {size} is more than the MLP's {model.intermediate_size} rows")


def tp_shard(model: ModelConfig, rank: int, size: int) -> TPShard:
    """Rank's shard of model over size ranks (check_tensor_parallel first). KV heads split as
    evenly as they go, each rank taking the query heads of its KV heads (so every rank keeps the
    model's GQA ratio, and uneven head counts, as SmolLM2's 9 over 2 ranks, still split);
    with fewer KV heads than ranks, size / num_kv_heads ranks share each one and split its group."""
    group = model.num_heads // model.num_kv_heads
    if model.num_kv_heads >= size:
        kv_heads = _even_part(model.num_kv_heads, rank, size)
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:
        sharing = size // model.num_kv_heads
        kv_head = rank // sharing
        kv_heads = range(kv_head, kv_head + 1)
        part = _even_part(group, rank % sharing, sharing)
        q_heads = range(kv_head * group + part.start, kv_head * group + part.stop)
    step = -(-model.vocab_size // size)
    vocab = range(min(rank * step, model.vocab_size), min((rank + 1) * step, model.vocab_size))
    return TPShard(rank, size, q_heads, kv_heads, _even_part(model.intermediate_size, rank, size), vocab, step)


def local_model_config(model: ModelConfig, shard: TPShard) -> ModelConfig:
    """model as rank's share of it: its heads and MLP rows (the sizes its kernels and KV cache see)."""
    if not shard.is_sharded:
        return model
    return dataclasses.replace(model, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                               intermediate_size=len(shard.intermediate))


def _even_part(total: int, index: int, parts: int) -> range:
    """Part index of range(total) cut into parts contiguous pieces, the first total % parts one longer."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))
