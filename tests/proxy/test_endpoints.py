"""vLLM's /tokenize, /detokenize and /version; X-Request-Id; max_tokens past the context (a
400 naming both numbers); and request fields: honoured, ignored as meaningless here, refused
as not supported (yet), or unknown and refused by name."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import threading
import time

import httpx
import pytest
import transformers

from engine import protocol
from tests.proxy.conftest import MODEL_NAME

_CHAT = "/v1/chat/completions"
_USER = [{"role": "user", "content": "hi"}]


def _post(proxy, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json=body, headers=headers or {}, timeout=10)


@pytest.fixture
def llama_proxy(start_proxy, llama_model_dir):
    return start_proxy(model_dir=str(llama_model_dir), api_key="k")


def _auth() -> dict:
    return {"Authorization": "Bearer k"}


def test_tokenize_a_prompt_adds_the_tokenizers_special_tokens(llama_proxy, llama_model_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_model_dir))
    text = "hello world caf\u00e9 \U0001f680"
    answer = _post(llama_proxy, "/tokenize", {"model": MODEL_NAME, "prompt": text}, _auth()).json()
    assert answer == {"count": len(hf(text)["input_ids"]), "max_model_len": 256, "tokens": hf(text)["input_ids"],
                      "token_strs": None}
    plain = _post(llama_proxy, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True},
                  _auth()).json()
    assert plain["tokens"] == answer["tokens"][1:]
    assert plain["token_strs"] == hf.convert_ids_to_tokens(plain["tokens"])


def test_tokenize_messages_renders_the_chat_template(llama_proxy, llama_model_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_model_dir))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, *_USER]
    answer = _post(llama_proxy, "/tokenize", {"model": MODEL_NAME, "messages": messages}, _auth()).json()
    assert answer["tokens"] == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    assert answer["tokens"].count(hf.bos_token_id) == 1


def test_detokenize_keeps_special_tokens_as_transformers_decode(llama_proxy, llama_model_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_model_dir))
    ids = hf("caf\u00e9 \U0001f680 the fox")["input_ids"]
    answer = _post(llama_proxy, "/detokenize", {"model": MODEL_NAME, "tokens": ids}, _auth())
    assert answer.json() == {"prompt": hf.decode(ids)} and answer.json()["prompt"].startswith("<s>")
    bad = _post(llama_proxy, "/detokenize", {"tokens": [1, 10**6]}, _auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_version_and_the_api_key_on_the_vllm_endpoints(llama_proxy):
    version = httpx.get(llama_proxy.base_url + "/version", headers=_auth(), timeout=5)
    assert version.json() == {"version": importlib.metadata.version("pdserve")}
    for method, path, body in (("GET", "/version", None), ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [1]})):
        response = httpx.request(method, llama_proxy.base_url + path, json=body, timeout=5)
        assert response.status_code == 401, path
    wrong_model = _post(llama_proxy, "/tokenize", {"model": "other", "prompt": "x"}, _auth())
    assert wrong_model.status_code == 404


def test_x_request_id_names_the_request_everywhere(proxy, caplog):
    caplog.set_level(logging.INFO, logger="proxy.service")
    headers = {"X-Request-Id": "job-42:part/1"}
    result = _post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}, headers)
    assert result.headers["x-request-id"] == "job-42:part/1" and result.json()["id"] == "cmpl-job-42:part/1"
    [request] = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert request.request_id.startswith("cmpl-job-42:part/1-") and request.request_id.endswith("-0")
    refused = _post(proxy, _CHAT, {"model": MODEL_NAME, "messages": _USER, "max_tokens": 10**6}, headers)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "job-42:part/1"
    assert any("chatcmpl-job-42:part/1" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    with httpx.stream("POST", proxy.base_url + _CHAT, json={"model": MODEL_NAME, "messages": _USER, "max_tokens": 2,
                                                            "stream": True}, headers=headers, timeout=10) as stream:
        assert stream.headers["x-request-id"] == "job-42:part/1"
        first = stream.read().decode().split("\n\n")[0]
        assert json.loads(first.removeprefix("data: "))["id"] == "chatcmpl-job-42:part/1"
    unnamed = _post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    assert unnamed.json()["id"] == "cmpl-" + unnamed.headers["x-request-id"]
    assert httpx.get(proxy.base_url + "/health", headers=headers, timeout=5).headers["x-request-id"] == "job-42:part/1"


@pytest.mark.parametrize("header", ["has space", "x" * 129, "caf\u00e9", ""])
def test_bad_x_request_ids_are_refused(proxy, header):
    response = _post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi"},
                     {"X-Request-Id": header.encode("utf-8")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"
    assert "x-request-id" not in response.headers


def test_one_request_id_used_twice_at_once_keeps_node_requests_apart(start_proxy):
    proxy = start_proxy(node={"step_s": 0.01})
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 20, "ignore_eos": True}
    results = []
    threads = [threading.Thread(target=lambda: results.append(_post(proxy, "/v1/completions", body,
                                                                    {"X-Request-Id": "same"}))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in results] == [200] * 3 and {r.json()["id"] for r in results} == {"cmpl-same"}
    node_ids = [r.request_id for r in proxy.prefill[0].messages(protocol.PrefillRequest)]
    assert len(set(node_ids)) == 3


@pytest.mark.parametrize("path, field, extra", [
    ("/v1/completions", "max_tokens", {"prompt": [1, 2, 3]}),
    (_CHAT, "max_tokens", {"messages": _USER}),
    (_CHAT, "max_completion_tokens", {"messages": _USER}),
])
def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(proxy, path, field, extra):
    ok = _post(proxy, path, {"model": MODEL_NAME, **extra, "max_tokens": 1})
    num_prompt_tokens = ok.json()["usage"]["prompt_tokens"]
    num_left = 256 - num_prompt_tokens
    response = _post(proxy, path, {"model": MODEL_NAME, **extra, field: num_left + 1})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and error["code"] == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in error["message"]
    assert f"you requested {num_left + 1} output tokens" in error["message"]
    assert f"your prompt contains {num_prompt_tokens} input tokens" in error["message"]
    assert _post(proxy, path, {"model": MODEL_NAME, **extra, field: num_left, "ignore_eos": True}).status_code == 200


def test_unset_max_tokens_is_the_protocol_default_or_the_context_left(proxy):
    _post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 3]})
    _post(proxy, _CHAT, {"model": MODEL_NAME, "messages": _USER})
    completion, chat = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert completion.sampling.max_tokens == protocol.SamplingOptions().max_tokens
    assert chat.sampling.max_tokens == 256 - len(chat.prompt_token_ids)  # as vLLM: up to the context
    long_prompt = list(range(1, 250))
    _post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": long_prompt})
    assert proxy.prefill[0].messages(protocol.PrefillRequest)[-1].sampling.max_tokens == 256 - 249  # cut, as before


# Unknown top-level fields of completion bodies are ignored (tests/proxy/test_unknown_fields.py);
# inside an object, and on /tokenize, they are refused.
@pytest.mark.parametrize("path, body, names", [
    (_CHAT, {"messages": [{"role": "user", "content": "hi", "mood": "good"}]}, ["messages.0.mood"]),
    (_CHAT, {"messages": _USER, "stream_options": {"continuous_usage_stats": True}},
     ["stream_options.continuous_usage_stats"]),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "text", "strict": True}},
     ["response_format.strict"]),
    ("/tokenize", {"prompt": "hi", "truncate_prompt_tokens": 3}, ["truncate_prompt_tokens"]),
])
def test_unknown_fields_inside_objects_and_on_tokenize_are_refused_by_name(proxy, path, body, names):
    response = _post(proxy, path, {"model": MODEL_NAME, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == names[0]
    assert all(repr(name) in error["message"] for name in names), error


@pytest.mark.parametrize("path, field, value", [
    (_CHAT, "modalities", ["text", "audio"]),
    ("/v1/completions", "best_of", 3),
])
def test_fields_not_supported_yet_are_refused_by_name(proxy, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": _USER}
    response = _post(proxy, path, {"model": MODEL_NAME, **body, field: value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and "not supported" in error["message"], error
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


def test_harmless_openai_fields_are_accepted(proxy):
    chat = {"model": MODEL_NAME, "messages": _USER, "max_tokens": 1, "user": "u1", "metadata": {"k": "v"},
            "store": False, "service_tier": "auto", "prompt_cache_key": "p", "safety_identifier": "s",
            "response_format": {"type": "text"}, "modalities": ["text"], "logit_bias": {}, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
            "stop": ["\n\n"], "presence_penalty": 0.5, "frequency_penalty": 0.1, "n": 2, "logprobs": True,
            "top_logprobs": 2, "temperature": 0.7, "top_p": 0.9}
    assert _post(proxy, _CHAT, chat).status_code == 200
    completion = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "user": "u1", "best_of": 2, "n": 2,
                  "echo": True, "stop": "x", "seed": 1, "logit_bias": {}}
    assert _post(proxy, "/v1/completions", completion).status_code == 200
    assert _post(proxy, "/v1/completions", {**completion, "best_of": 1}).json()["error"]["param"] == "best_of"


def test_probes_are_debug_lines_in_the_access_log_and_requests_info(proxy, caplog):
    caplog.set_level(logging.DEBUG, logger="proxy.access")
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(proxy.base_url + path, timeout=5).status_code == 200
    assert _post(proxy, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).status_code == 200
    assert httpx.get(proxy.base_url + "/nosuch", timeout=5).status_code == 404
    deadline = time.monotonic() + 5
    while len([r for r in caplog.records if r.name == "proxy.access"]) < 5:  # written as each response ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
    levels = {r.getMessage().split()[1]: r.levelno for r in caplog.records if r.name == "proxy.access"}
    assert levels == {"/health": logging.DEBUG, "/ready": logging.DEBUG, "/metrics": logging.DEBUG,
                      "/v1/completions": logging.INFO, "/nosuch": logging.INFO}
