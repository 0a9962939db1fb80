"""Loading a Hugging Face Llama-family checkpoint (safetensors) into the engine's fused layout."""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig
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


def load_weights(config: ModelConfig, backend: Backend, decode_batches: bool = True) -> ModelWeights:
    """Read every *.safetensors file of config.model_dir onto the backend's device, each projection
    prepared in its form. Raises FileNotFoundError when there is none and KeyError naming a missing
    tensor. decode_batches=False (a prefill-only engine) skips the projections' copies for
    decode-sized batches (Backend.prepare_linear's small_batches)."""
    device = backend.device
    tensors = _read_safetensors(Path(config.model_dir))

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"checkpoint {config.model_dir} has no tensor {name!r}")
        return tensors.pop(name).to(device=device, dtype=config.dtype)

    def take_optional(name: str) -> torch.Tensor | None:
        return take(name) if name in tensors else None

    prepare = functools.partial(backend.prepare_linear, small_batches=decode_batches)
    layers = [_load_layer(config, i, take, take_optional, prepare) for i in range(config.num_layers)]
    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else take_optional("lm_head.weight")
    if lm_head is None:
        logger.warning("no lm_head.weight in %s: tying it to the embedding", config.model_dir)
        lm_head = embed
    head = prepare(lm_head, copy=False)
    greedy = backend.prepare_greedy_head(lm_head, head) if decode_batches else None
    return ModelWeights(embed, layers, take("model.norm.weight"), head, greedy)


def _load_layer(config: ModelConfig, idx: int, take, take_optional, prepare) -> LayerWeights:
    prefix = f"model.layers.{idx}."
    attn = prefix + "self_attn."
    qkv = torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"])
    qkv_bias = None
    if config.has_qkv_bias:
        qkv_bias = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
    mlp = prefix + "mlp."
    o_bias = take_optional(attn + "o_proj.bias") if config.has_o_bias else None
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight"),
        qkv=prepare(qkv, qkv_bias),
        o=prepare(take(attn + "o_proj.weight"), o_bias),
        post_norm=take(prefix + "post_attention_layernorm.weight"),
        gate_up=prepare(torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]), gate_up=True),
        down=prepare(take(mlp + "down_proj.weight")),
    )


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable itself
            for name in names:
                tensors[name] = f.get_tensor(name)
    return tensors


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
