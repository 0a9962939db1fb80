"""`pdserve make-model OUT --preset tiny|small|qwen2-tiny`: a random-weight HF checkpoint with a
byte-level BPE tokenizer trained locally on the running Python's standard-library sources.

Nothing is downloaded. The same preset and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
CHAT_END_TOKEN = "<|im_end|>"
# Trained first, so their ids are 0, 1, 2, 3 in this order.
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", CHAT_END_TOKEN, "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Preset:
    architecture: str  # "llama" | "qwen2"
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


PRESETS = {
    "tiny": Preset("llama", 2048, 256, 4, 4, 2, 512, False, 1_000_000),
    # SmolLM-135M's shape and vocabulary size. The whole standard library (12.6 MB of non-test
    # sources on 3.11; the cap is never reached) trains 49152 tokens in ~9 s.
    "small": Preset("llama", 49152, 576, 30, 9, 3, 1536, True, 24_000_000),
    "qwen2-tiny": Preset("qwen2", 2048, 256, 4, 4, 2, 512, True, 1_000_000),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = make_model(args.out, args.preset, args.seed)
    print(f"wrote {args.preset} model to {path}")
    return 0


def make_model(out_dir: str | Path, preset: str, seed: int = 0, show_progress: bool = True) -> Path:
    """Write the checkpoint into out_dir (created); returns its path. Raises ValueError for an
    unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.corpus_bytes, show_progress)
    tokenizer.save(str(out / "tokenizer.json"))
    # The trainer stops short of vocab_size when the corpus runs out of merges (an unusually small
    # standard library); the embedding then matches the tokenizer, not the preset.
    spec = dataclasses.replace(spec, vocab_size=tokenizer.get_vocab_size())
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    if show_progress:
        print(f"make-model: building and writing {preset} weights (seed {seed}) ...", file=sys.stderr, flush=True)
    model = _random_model(spec, seed, eos_id)
    model.save_pretrained(out, safe_serialization=True)
    # Written after save_pretrained, which writes its own. <|im_end|> ends a chat reply, so it
    # stops generation too (as in Qwen2 instruct checkpoints); config.json keeps eos_id alone.
    generation_config = {"bos_token_id": eos_id, "eos_token_id": [eos_id, tokenizer.token_to_id(CHAT_END_TOKEN)]}
    _write_json(out / "generation_config.json", generation_config)
    return out


def train_tokenizer(vocab_size: int, corpus_bytes: int, show_progress: bool = True):
    """A byte-level BPE trained on the standard library's .py files (sorted: deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=show_progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(corpus_bytes), trainer)
    return tokenizer


def _corpus(max_bytes: int):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "test", "tests"} & set(p.parts))
    num_bytes = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        num_bytes += len(text)
        yield text
        if num_bytes >= max_bytes:
            return


def _tokenizer_config(spec: Preset) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _random_model(spec: Preset, seed: int, eos_id: int):
    import torch
    import transformers

    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=1e-5, bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    if spec.architecture == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_class = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_class(config)
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


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
