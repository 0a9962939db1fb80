"""response_format, tools with tool_choice "required", logit_bias and echo with logprobs through
real processes on the tiny random model: grammar-bound outputs always parse and validate (checked
by hand against bounded schemas) and agree between colocated and disaggregated serving for the
same seed; logit_bias and prompt logprobs equal transformers on the same checkpoint."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
import transformers

from tests.e2e.test_pipeline import PROMPT, client_for, hf_greedy, model_name

NAME_AGE_COLOR = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"], "additionalProperties": False,
}
FLAG_TAGS_CITY = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                       "maxItems": 3},
                   "city": {"type": "string", "maxLength": 10}},
    "required": ["ok", "tags", "city"], "additionalProperties": False,
}
SCHEMAS = (NAME_AGE_COLOR, FLAG_TAGS_CITY)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 12},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["query", "limit"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
NUM_SEEDED = 20
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _is_bounded_string(value, max_length: int) -> bool:
    return isinstance(value, str) and len(value) <= max_length


def matches(value, schema: dict) -> bool:
    """value against one of SCHEMAS, checked by hand (every keyword they use)."""
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    if schema is NAME_AGE_COLOR:
        age = value["age"]
        return (_is_bounded_string(value["name"], 8) and isinstance(age, int) and not isinstance(age, bool)
                and 0 <= age <= 99 and value["color"] in ("red", "green", "blue"))
    tags = value["tags"]
    return (isinstance(value["ok"], bool) and isinstance(tags, list) and len(tags) <= 3
            and all(t in ("a", "b", "c") for t in tags) and _is_bounded_string(value["city"], 10))


def call_matches(name: str, arguments: dict) -> bool:
    """A tool call's arguments against its tool's parameters, checked by hand."""
    if name == "get_weather":
        return (set(arguments) == {"city", "unit"} and arguments["city"] in ("Paris", "Oslo", "Lima")
                and arguments["unit"] in ("C", "F"))
    limit = arguments.get("limit")
    return (name == "search" and set(arguments) == {"query", "limit"} and _is_bounded_string(arguments["query"], 12)
            and isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= 5)


async def _seeded_json_outputs(deployment) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    name = (await client.models.list()).data[0].id

    async def one(seed: int):
        schema = SCHEMAS[seed % len(SCHEMAS)]
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{seed % 2}", "schema": schema,
                                                                  "strict": True}}
        return await client.chat.completions.create(model=name, messages=MESSAGES, temperature=1.0, seed=seed,
                                                    max_tokens=MAX_TOKENS, response_format=response_format)

    replies = await asyncio.gather(*(one(seed) for seed in range(NUM_SEEDED)))
    return [(r.choices[0].message.content, r.choices[0].finish_reason) for r in replies]


def test_seeded_json_schema_outputs_validate_and_agree_colocated_and_disaggregated(disaggregated, colocated):
    outputs = {mode: asyncio.run(_seeded_json_outputs(deployment))
               for mode, deployment in (("pd", disaggregated), ("colo", colocated))}
    for seed, (text, finish_reason) in enumerate(outputs["pd"]):
        assert finish_reason == "stop", (seed, text)
        assert matches(json.loads(text), SCHEMAS[seed % len(SCHEMAS)]), (seed, text)
    assert outputs["pd"] == outputs["colo"]
    assert len({text for text, _ in outputs["pd"]}) > NUM_SEEDED // 2  # temperature 1: the seeds differ


@pytest.mark.parametrize("parallel_tool_calls", [False, None])
def test_required_tool_choice_always_gives_a_valid_call(disaggregated, parallel_tool_calls):
    client = client_for(disaggregated)
    name = model_name(client)
    extra = {} if parallel_tool_calls is None else {"parallel_tool_calls": parallel_tool_calls}
    for seed in range(6):
        reply = client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, **extra)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice.message)
        calls = choice.message.tool_calls
        assert calls and (len(calls) == 1 or parallel_tool_calls is None), (seed, calls)
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            assert call_matches(call.function.name, json.loads(call.function.arguments)), (seed, call)
        assert reply.usage.completion_tokens <= MAX_TOKENS


def test_named_tool_choice_streams_one_call_of_that_tool(colocated):
    client = client_for(colocated)
    chunks = [c for c in client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "search"}}, stream=True) if c.choices]
    [call] = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert call.function.name == "search" and call_matches("search", json.loads(call.function.arguments))
    assert chunks[-1].choices[0].finish_reason == "stop"  # OpenAI's for a named function
    assert not any(c.choices[0].delta.content for c in chunks)


def hf_greedy_biased(hf, prompt_ids: list[int], max_tokens: int, logit_bias: dict[int, float]) -> list[int]:
    """Greedy tokens with logit_bias added to every step's logits (stops at EOS, as the engine)."""
    model, _ = hf
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    bias = torch.zeros(model.config.vocab_size)
    for token_id, value in logit_bias.items():
        bias[token_id] = value
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            token_id = int((model(torch.tensor([ids])).logits[0, -1].float() + bias).argmax())
            out.append(token_id)
            ids.append(token_id)
            if token_id in eos_ids:
                break
    return out


def test_logit_bias_greedy_equals_transformers_with_the_bias(disaggregated, colocated, hf):
    _, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPT)
    plain, _ = hf_greedy(hf, prompt_ids, 12)
    logit_bias = {plain[0]: -100.0, plain[1]: -100.0, 300: 6.0, 1200: 3.5}
    want = hf_greedy_biased(hf, prompt_ids, 12, logit_bias)
    assert want[:len(plain)] != plain  # the bias changes the output
    for deployment in (disaggregated, colocated):
        client = client_for(deployment)
        got = client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=12, temperature=0,
                                        logit_bias={str(t): b for t, b in logit_bias.items()})
        assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        assert got.usage.completion_tokens == len(want)


def test_echo_logprobs_equal_transformers_prompt_log_softmax(disaggregated, colocated, hf):
    model, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), -1)  # [num_prompt, vocab]
    completion_ids, completion_logprobs = hf_greedy(hf, prompt_ids, 5)
    num_prompt = len(prompt_ids)
    for deployment in (disaggregated, colocated):
        client = client_for(deployment)
        name = model_name(client)
        whole = client.completions.create(model=name, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                          logprobs=3).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(
            model=name, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=3, stream=True) if c.choices]
        assert whole.text == "".join(c.text for c in chunks) == PROMPT + tokenizer.decode(completion_ids,
                                                                                          skip_special_tokens=True)
        for logprobs in (whole.logprobs, _joined([c.logprobs for c in chunks])):
            token_logprobs = logprobs.token_logprobs
            assert len(token_logprobs) == num_prompt + len(completion_ids)
            assert token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            for idx in range(1, num_prompt):
                assert abs(token_logprobs[idx] - want[idx - 1, prompt_ids[idx]].item()) < 1e-4, idx
                top = sorted(logprobs.top_logprobs[idx].values(), reverse=True)
                assert max(abs(a - b) for a, b in zip(top, want[idx - 1].topk(3).values.tolist())) < 1e-4, idx
            assert max(abs(a - b) for a, b in zip(token_logprobs[num_prompt:], completion_logprobs)) < 1e-4


def _joined(pieces) -> openai.types.completion_choice.Logprobs:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return openai.types.completion_choice.Logprobs.construct(
        **{key: [v for piece in pieces for v in getattr(piece, key)] for key in keys})
