"""The proxy's OpenAI API, driven with the official openai client against fake nodes."""

from __future__ import annotations

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from engine import protocol
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fake_node import next_token


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _expected_ids(prompt_ids: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(next_token(prompt_ids, out, vocab_size))
    return out


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_completion_disaggregated_follows_prefill_then_decode(proxy, tokenizer, vocab_size):
    prompt_ids = tokenizer.encode("hello world").ids
    result = proxy.client().completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6,
                                               extra_body={"ignore_eos": True})
    assert result.choices[0].text == _decode(tokenizer, _expected_ids(prompt_ids, 6, vocab_size))
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        len(prompt_ids), 6, len(prompt_ids) + 6)
    [prefill_request] = proxy.prefill[0].messages(protocol.PrefillRequest)
    [decode_request] = proxy.decode[0].messages(protocol.DecodeRequest)
    assert prefill_request.prompt_token_ids == decode_request.prompt_token_ids == prompt_ids
    assert decode_request.kv_handle is not None and decode_request.first_token is not None
    assert decode_request.request_id == prefill_request.request_id == result.id + "-0"


def test_colocated_mode_sends_one_decode_request_without_handle(start_proxy, tokenizer, vocab_size):
    proxy = start_proxy(num_prefill=0, num_decode=1)
    result = proxy.client().completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4)
    assert result.choices[0].text == _decode(tokenizer, _expected_ids([5, 6, 7], 4, vocab_size))
    [request] = proxy.decode[0].messages(protocol.DecodeRequest)
    assert request.kv_handle is None and request.first_token is None


def test_streaming_equals_non_streaming_and_ends_with_done(proxy):
    client = proxy.client()
    whole = client.completions.create(model=MODEL_NAME, prompt="the quick", max_tokens=10).choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="the quick", max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    with httpx.stream("POST", proxy.base_url + "/v1/completions", timeout=10,
                      json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_chat_stream_and_whole_with_role_first(proxy, tokenizer):
    client = proxy.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    expected_prompt = ("<|endoftext|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                       "<|im_start|>assistant\n")
    prompt_ids = proxy.prefill[0].messages(protocol.PrefillRequest)[0].prompt_token_ids
    assert prompt_ids == tokenizer.encode(expected_prompt).ids
    assert whole.usage.prompt_tokens == len(prompt_ids)


def test_max_completion_tokens_and_sampling_fields_reach_the_node(proxy):
    proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, temperature=0.5,
        top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=-0.5,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [9],
                    "ignore_eos": True})
    sampling = proxy.prefill[0].messages(protocol.PrefillRequest)[0].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        3, 0.5, 0.9, 5, 0.1)
    assert (sampling.seed, sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (
        7, 0.5, -0.5, 1.1)
    assert (sampling.min_tokens, sampling.stop_token_ids, sampling.ignore_eos) == (2, [9], True)


def test_n_fans_out_with_indexed_ids_and_seeds(proxy):
    result = proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, n=3, seed=10)
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    requests = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert sorted(r.request_id for r in requests) == [f"{result.id}-{i}" for i in range(3)]
    assert sorted(r.sampling.seed for r in requests) == [10, 11, 12]
    assert result.usage.completion_tokens == 9 and result.usage.prompt_tokens == len(requests[0].prompt_token_ids)


def test_list_of_prompts_gets_one_choice_each(proxy, tokenizer, vocab_size):
    result = proxy.client().completions.create(model=MODEL_NAME, prompt=["hello", "world"], max_tokens=2)
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert texts == [_decode(tokenizer, _expected_ids(tokenizer.encode(p).ids, 2, vocab_size))
                     for p in ("hello", "world")]
    token_lists = proxy.client().completions.create(model=MODEL_NAME, prompt=[[1, 2], [3, 4, 5]], max_tokens=1)
    assert token_lists.usage.prompt_tokens == 5


def test_echo_prepends_the_prompt(proxy):
    result = proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2, echo=True)
    assert result.choices[0].text.startswith("hello")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_truncates_and_aborts(start_proxy, tokenizer, stream):
    script = tokenizer.encode("hello there! How are you").ids
    stop = "re! Ho"  # spans several tokens
    assert not any(stop in tokenizer.decode([t]) for t in script)
    proxy = start_proxy(node={"script": script})
    client = proxy.client()
    if stream:
        chunks = list(client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=50, stop=[stop],
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=50, stop=stop).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert (text, reason) == ("hello the", "stop")
    assert proxy.decode[0].wait_for(lambda: proxy.decode[0].messages(protocol.Abort), 1.0)
    assert proxy.decode[0].num_running() == 0


def test_stop_token_from_node_ends_with_stop(start_proxy, tokenizer):
    eos = tokenizer.token_to_id("<|endoftext|>")
    proxy = start_proxy(node={"script": tokenizer.encode("ab cd").ids + [eos], "eos_token_id": eos})
    choice = proxy.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=50).choices[0]
    assert (choice.text, choice.finish_reason) == ("ab cd", "stop")


def test_finish_at_prefill_needs_no_decode_node(proxy):
    result = proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=1)
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 1
    assert proxy.decode[0].messages(protocol.DecodeRequest) == []


def test_include_usage_adds_a_final_chunk_with_empty_choices(proxy):
    chunks = list(proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.choices[0].index for c in chunks[:-1]} == {0, 1}


def test_completion_logprobs_in_the_legacy_format(proxy, tokenizer):
    result = proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert logprobs.token_logprobs == [-0.5] * 3 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert all(b >= a for a, b in zip(logprobs.text_offset, logprobs.text_offset[1:]))
    assert proxy.prefill[0].messages(protocol.PrefillRequest)[0].sampling.logprobs == 2
    streamed = list(proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, logprobs=2,
                                                      stream=True))
    offsets = [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset


def test_chat_logprobs_with_top_logprobs(proxy):
    result = proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 3 and entry.logprob == -0.5 for entry in content)
    plain = proxy.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_return_tokens_as_token_ids_names_every_token_by_its_id(start_proxy, tokenizer):
    """vLLM's return_tokens_as_token_ids: logprobs' tokens (chosen, alternatives, the echoed
    prompt's) are "token_id:N", so tokens without text stay apart; the text and its offsets as
    without it; in chat, bytes are the name's."""
    script = tokenizer.encode("caf\u00e9 \U0001f680 ok").ids
    proxy = start_proxy(node={"script": script})
    prompt_ids = tokenizer.encode("hello world").ids
    ask = dict(model=MODEL_NAME, prompt=prompt_ids, max_tokens=len(script), logprobs=2, echo=True)
    named = proxy.client().completions.create(**ask, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    plain = proxy.client().completions.create(**ask).choices[0]
    assert named.logprobs.tokens == [f"token_id:{i}" for i in prompt_ids + script]
    assert all(key.startswith("token_id:") for top in named.logprobs.top_logprobs[1:] for key in top)
    assert named.text == plain.text and named.logprobs.text_offset == plain.logprobs.text_offset
    assert named.logprobs.tokens != plain.logprobs.tokens
    streamed = [c.choices[0].logprobs for c in proxy.client().completions.create(
        **{**ask, "echo": False}, stream=True, extra_body={"return_tokens_as_token_ids": True}) if c.choices]
    assert [t for lp in streamed if lp for t in lp.tokens] == [f"token_id:{i}" for i in script]
    chat = proxy.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=len(script), logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    content = chat.logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{i}" for i in script]
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert all(alt.token.startswith("token_id:") for entry in content for alt in entry.top_logprobs)


def test_multibyte_characters_split_across_tokens_stream_whole(start_proxy, tokenizer):
    text = "caf\u00e9 \U0001f680 \u4f60\u597d"
    script = tokenizer.encode(text).ids
    assert len(script) > len(text.split())  # the emoji and CJK characters span several byte tokens
    proxy = start_proxy(node={"script": script})
    chunks = list(proxy.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=len(script),
                                                    stream=True))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


def test_models_lists_the_served_model(proxy):
    models = proxy.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_models_retrieve_answers_for_the_served_model_and_404s_others(proxy):
    """The openai client's models.retrieve: GET /v1/models/{id}, as in the list; another id is a
    404 with an OpenAI error naming the served model."""
    client = proxy.client()
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.owned_by == "pdserve"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/other-model")
    assert caught.value.body["code"] == "model_not_found" and MODEL_NAME in caught.value.body["message"]
