"""pdserve make-model: deterministic files, loadable by transformers, a round-tripping tokenizer,
a chat template, and weights whose greedy choices are clear and vary with the prompt."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from pdserve.make_model import make_model

CHECKPOINT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json"]
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
