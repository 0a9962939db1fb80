"""Loading a Hugging Face Llama-family checkpoint (safetensors) into the engine's fused layout."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.tp_shard import TPShard, tp_shard
from kernels.interface import Backend

logger = logging.getLogger(__name__)


# NOTE: each projection is in the engine's backend's own form (Backend.prepare_linear).


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Any  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim, optional bias
    o: Any  # num_heads * head_dim -> hidden, optional bias
    post_norm: torch.Tensor  # [hidden]
    gate_up: Any  # hidden -> 2 * intermediate
    down: Any  # intermediate -> hidden


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Any  # hidden -> vocab
    # the backend's greedy-head capability for the LM head (decode-capable engines): the token of a
    # plain greedy row without its logits; None where the backend has none
    greedy_head: Any | None = None


def load_weights(config: ModelConfig, backend: Backend, decode_batches: bool = True,
                 shard: TPShard | None = None) -> ModelWeights:
    """Read every *.safetensors file of config.model_dir onto the backend's device, each projection
    prepared in its form. Raises FileNotFoundError when there is none and KeyError naming a missing
    tensor. decode_batches=False (a prefill-only engine) skips the projections' copies for
    decode-sized batches (Backend.prepare_linear's small_batches). shard (a tensor-parallel rank's):
    only its slices are read (tp_shard): column-parallel QKV and gate/up, row-parallel O and down
    (the O bias on rank 0 alone: the ranks' outputs are summed), the vocabulary rows of the
    embedding and the LM head; no greedy head (the logits are gathered)."""
    device = backend.device
    shard = shard or tp_shard(config, 0, 1)
    with _Checkpoint(Path(config.model_dir)) as checkpoint:

        def take(name: str, dim: int = 0, part: range | None = None) -> torch.Tensor:
            if name not in checkpoint:
                raise KeyError(f"checkpoint {config.model_dir} has no tensor {name!r}")
            return checkpoint.read(name, dim, part if shard.is_sharded else None).to(device=device,
                                                                                   dtype=config.dtype)

        def take_optional(name: str, dim: int = 0, part: range | None = None) -> torch.Tensor | None:
            return take(name, dim, part) if name in checkpoint else None

        prepare = functools.partial(backend.prepare_linear, small_batches=decode_batches)
        layers = [_load_layer(config, shard, i, take, take_optional, prepare) for i in range(config.num_layers)]
        embed = take("model.embed_tokens.weight", 0, shard.vocab)
        lm_head = embed if config.tie_word_embeddings else take_optional("lm_head.weight", 0, shard.vocab)
        norm = take("model.norm.weight")
    if lm_head is None:
        logger.warning("no lm_head.weight in %s: tying it to the embedding", config.model_dir)
        lm_head = embed
    head = prepare(lm_head, copy=False)
    greedy = backend.prepare_greedy_head(lm_head, head) if decode_batches and not shard.is_sharded else None
    return ModelWeights(embed, layers, norm, head, greedy)


def _load_layer(config: ModelConfig, shard: TPShard, idx: int, take, take_optional, prepare) -> LayerWeights:
    prefix = f"model.layers.{idx}."
    attn = prefix + "self_attn."
    dim = config.head_dim
    q_rows = range(shard.q_heads.start * dim, shard.q_heads.stop * dim)
    kv_rows = range(shard.kv_heads.start * dim, shard.kv_heads.stop * dim)
    parts = {"q": q_rows, "k": kv_rows, "v": kv_rows}
    qkv = torch.cat([take(attn + f"{p}_proj.weight", 0, parts[p]) for p in "qkv"])
    qkv_bias = None
    if config.has_qkv_bias:
        qkv_bias = torch.cat([take(attn + f"{p}_proj.bias", 0, parts[p]) for p in "qkv"])
    mlp = prefix + "mlp."
    o_bias = take_optional(attn + "o_proj.bias") if config.has_o_bias and shard.rank == 0 else None
    rows = shard.intermediate
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight"),
        qkv=prepare(qkv, qkv_bias),
        o=prepare(take(attn + "o_proj.weight", 1, q_rows), o_bias),
        post_norm=take(prefix + "post_attention_layernorm.weight"),
        gate_up=prepare(torch.cat([take(mlp + "gate_proj.weight", 0, rows), take(mlp + "up_proj.weight", 0, rows)]),
                        gate_up=True),
        down=prepare(take(mlp + "down_proj.weight", 1, rows)),
    )


class _Checkpoint:
    """Every *.safetensors file of a directory, open for the block: a tensor is read when asked
    for, whole or a slice along one dimension (only that slice's bytes are read)."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
        self._files = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        for path in files:
            handle = self._files.enter_context(safe_open(str(path), framework="pt"))
            names = handle.keys()  # a safe_open handle is not iterable itself
            self._where.update(dict.fromkeys(names, handle))

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, dim: int = 0, part: range | None = None) -> torch.Tensor:
        handle = self._where[name]
        if part is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[(slice(None),) * dim + (slice(part.start, part.stop),)]


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash naming the checkpoint: config.json plus each weight file's name, size and
    first and last MiB (hashing whole multi-GB files would slow every start)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]
