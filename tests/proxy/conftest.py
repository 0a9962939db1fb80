"""Proxy test fixtures: tiny model directories (no weights) with a GPT-2-style byte-level BPE
tokenizer and a Llama-style one (byte fallback, a post-processor adding BOS), fake nodes, and a
real uvicorn server on a free 127.0.0.1 port, always shut down."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.protocol import Role
from pdserve.ports import wait_http_ok
from proxy.app import create_app, server_options
from proxy.config import ProxyConfig
from tests.conftest import UvicornServer
from tests.proxy.fake_node import FakeNode, FakeNodeConfig

MODEL_NAME = "tiny-test"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 2's template, shortened: BOS once at the start, [INST] around user turns.
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
    "message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + "
    "eos_token }}{% else %}{{ '<<SYS>>' + message['content'] + '<</SYS>>' }}{% endif %}{% endfor %}"
)
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Hello there! How are you today? I am fine, thank you.",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
] * 20


def _write_model_dir(path: Path) -> Path:
    """GPT-2 style: byte-level BPE, no post-processor (encoding adds no special tokens)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"}, "chat_template": CHAT_TEMPLATE}
    return _save(path, tokenizer, tokenizer_config, eos_ids=[eos_id, tokenizer.token_to_id("<|im_end|>")])


def llama_style_tokenizer() -> Tokenizer:
    """Llama 2 style, as converted from SentencePiece: spaces as "▁", BPE with byte fallback
    (<0xNN> tokens for characters not in the vocabulary), and a post-processor adding <s>."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # training only
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=LLAMA_SPECIAL_TOKENS, show_progress=False,
                                  limit_alphabet=60)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    data = json.loads(tokenizer.to_str())
    for byte in range(256):
        data["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(data["model"]["vocab"]))
    data["model"]["byte_fallback"] = True
    data["pre_tokenizer"] = None
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", bos_id)])
    return tokenizer


def _write_llama_model_dir(path: Path) -> Path:
    tokenizer = llama_style_tokenizer()
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                        "unk_token": "<unk>", "chat_template": LLAMA_CHAT_TEMPLATE}
    return _save(path, tokenizer, tokenizer_config, eos_ids=[tokenizer.token_to_id("</s>")])


def _save(path: Path, tokenizer: Tokenizer, tokenizer_config: dict, eos_ids: list[int]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    files = {
        "tokenizer_config.json": tokenizer_config,
        "config.json": {"vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": 256,
                        "eos_token_id": eos_ids[0]},
        "generation_config.json": {"eos_token_id": eos_ids},
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return _write_model_dir(tmp_path_factory.mktemp("proxy-model"))


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory) -> Path:
    return _write_llama_model_dir(tmp_path_factory.mktemp("proxy-llama-model"))


@pytest.fixture(scope="session")
def vocab_size(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


@dataclass
class RunningProxy:
    base_url: str
    config: ProxyConfig
    prefill: list[FakeNode] = field(default_factory=list)
    decode: list[FakeNode] = field(default_factory=list)
    app: object = None  # the FastAPI app (its state: pool, ledger, ...)

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.config.api_key or "none")
        return openai.OpenAI(base_url=self.base_url + "/v1", max_retries=0, timeout=20, **kwargs)


@pytest.fixture
def start_proxy(model_dir) -> Iterator:
    """start_proxy(num_prefill=1, num_decode=1, node=dict(FakeNodeConfig fields), wait=True,
    extra_decode_addresses=(), **ProxyConfig fields) -> a healthy RunningProxy; nodes and server stop at teardown.
    ProxyConfig's model_dir defaults to the byte-level model's."""
    started: list = []

    def start(num_prefill: int = 1, num_decode: int = 1, node: dict | None = None, wait: bool = True,
              extra_decode_addresses: tuple[str, ...] = (), **config_fields) -> RunningProxy:
        config_fields.setdefault("model_dir", str(model_dir))
        model_vocab_size = json.loads((Path(config_fields["model_dir"]) / "config.json").read_text())["vocab_size"]
        node_fields = {"vocab_size": model_vocab_size, **(node or {})}
        prefill = [FakeNode(FakeNodeConfig(role=Role.PREFILL, **node_fields)).start() for _ in range(num_prefill)]
        decode = [FakeNode(FakeNodeConfig(role=Role.DECODE, **node_fields)).start() for _ in range(num_decode)]
        started.extend(prefill + decode)
        # The production default: the fake nodes share this process's GIL with the proxy, and a
        # loaded 2-core CI machine starved them past a 1 s timeout (a live node failed as silent).
        config_fields.setdefault("heartbeat_timeout_s", 3.0)
        config = ProxyConfig(served_model_name=MODEL_NAME,
                             prefill_addresses=tuple(n.address for n in prefill),
                             decode_addresses=(*(n.address for n in decode), *extra_decode_addresses),
                             **config_fields)
        app = create_app(config)
        server = UvicornServer(app, lifespan="on", **server_options(config))
        started.append(server)
        server.start()
        running = RunningProxy(f"http://127.0.0.1:{server.port}", config, prefill, decode, app)
        if wait:
            wait_http_ok(running.base_url + "/health", timeout_s=10.0)
        return running

    yield start
    for thing in reversed(started):
        thing.stop()


@pytest.fixture
def proxy(start_proxy) -> RunningProxy:
    """One fake prefill node, one fake decode node and the proxy in front of them."""
    return start_proxy()
