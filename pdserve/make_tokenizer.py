"""Tokenizers for make-model's random presets, trained locally on the running Python's standard
library: a byte-level BPE with ChatML special tokens, and a SentencePiece-style BPE laid out as Mistral
v0.1/v0.2's. Also their files, and write_json: the layout of every JSON file make-model writes itself."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

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


def save_tokenizer(tokenizer, out: Path, model_max_length: int) -> None:
    """Saved by transformers' own save_pretrained, so the files are laid out as a checkpoint of
    current transformers ships them (tokenizer_config.json without the template, the template in
    chat_template.jinja): the fixtures then test what real checkpoints look like."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token="<|pad|>",
        model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def save_sentencepiece_tokenizer(tokenizer, out: Path, model_max_length: int) -> None:
    """tokenizer.json, and tokenizer_config.json as Mistral's v0.1/v0.2 checkpoints have it (written
    by transformers 4: class LlamaTokenizer, the chat template inside), with special_tokens_map.json."""
    tokenizer.save(str(out / "tokenizer.json"))
    names = dict(zip(("unk_token", "bos_token", "eos_token"), SP_SPECIAL_TOKENS))
    added = {str(tokenizer.token_to_id(token)): {"content": token, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
             for token in SP_SPECIAL_TOKENS}
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added, "chat_template": SP_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": model_max_length,
        "pad_token": None, "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer", **names})
    write_json(out / "special_tokens_map.json", names)


def write_json(path: Path, data: dict) -> None:
    """data as every JSON file make-model writes itself: indented, keys sorted, a final newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
