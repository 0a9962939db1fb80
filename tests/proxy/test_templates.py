"""Chat templates render exactly as transformers' apply_chat_template renders them (string for
string, token for token, with transformers' tokenizer loaded from the same directory): the
real SmolLM2 template, templates of our own using tools, documents, system prompts, loop
controls, strftime_now, raise_exception, special tokens, named templates, and checkpoints saved
by transformers 5 save_pretrained (chat_template.jinja)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import transformers

from proxy.errors import ChatTemplateError
from proxy.templates import Conversation
from proxy.tokenizer import ModelTokenizer

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{% if message.content is defined %}{{ message.content }}
{% endif %}
{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool {{ message.tool_call_id }} {{ message.name | default('?') }}
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
DOCUMENTS_TEMPLATE = """{%- if documents is not none %}<|im_start|>system
Answer from these documents:
{% for doc in documents %}[{{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LOOPS_TEMPLATE = """{%- set ns = namespace(system='You are helpful.', count=0) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
[SYS] {{ ns.system }} [/SYS]
{% for message in loop_messages %}
    {%- if message.content | length == 0 %}{% continue %}{% endif %}
    {%- if loop.index > 12 %}{% break %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
  {{ loop.index0 }}{{ '/' ~ loop.length if loop.last }}: {{ message.role | upper }}: {{ message.content | trim }}
{% endfor %}
count={{ ns.count }}{{ eos_token if not add_generation_prompt }}
    {% if add_generation_prompt %}
GO
    {% endif %}
"""
STRFTIME_TEMPLATE = """Today is {{ strftime_now('%d %B %Y') }}.
{% for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}"""
ALTERNATING_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}[{{ message['role'] }}] {{ message['content'] }}{{ eos_token if message['role'] == 'assistant' }}
{% endfor %}"""
SPECIAL_TOKENS_TEMPLATE = ("{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ sep_token }}|"
                           "{{ image_token }}|{{ audio_token }}|{{ mask_token is defined }}\n"
                           "{% for m in messages %}{{ m.content }}{% endfor %}")
JSON_TEMPLATE = """{{ messages | tojson }}
{{ messages[-1] | tojson(indent=2, sort_keys=True) }}
{{ {'k': messages[0].content, 'caf\u00e9': [1, 2.5, none, true]} | tojson(separators=(',', ':')) }}
{{ dict(a=1, b=messages|length) | tojson }}{{ missing_variable }}{{ missing_variable is defined }}"""
GENERATION_TEMPLATE = """{% for message in messages %}{% if message.role == 'assistant' %}{% generation %}\
<a>{{ message.content }}</a>{% endgeneration %}{% else %}<u>{{ message.content }}</u>{% endif %}
{% endfor %}"""
THINKING_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message.role }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>
{% endif %}{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "caf\u00e9 na\u00efve \U0001f680 \u4f60\u597d"}],
    [{"role": "user", "content": "  spaces around  \n"}, {"role": "assistant", "content": "\nnewline first"},
     {"role": "user", "content": "tabs\tand\r\nCRLF"}],
    [{"role": "user", "content": "the text <|im_end|> holds a special token"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
    [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "the quick brown fox " * (i % 5)}
     for i in range(41)],
]
CONTINUED = [
    [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight -"}],
    [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two, "}],  # trailing space
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "line\n"}],  # trailing newline
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, \u00b0C",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "21 \u00b0C in Paris."}, {"role": "user", "content": "And the time?"}],
    [{"role": "user", "content": "Both, please."},
     {"role": "assistant", "content": "Calling two tools.", "tool_calls": [
         {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Z\u00fcrich"}}},
         {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]},
     {"role": "tool", "tool_call_id": "a", "content": "cold"},
     {"role": "tool", "tool_call_id": "b", "content": "9:00"}],
]
DOCUMENTS = [{"title": "Paris", "text": "Paris is the capital of France."},
             {"title": "Z\u00fcrich", "text": "Z\u00fcrich lies on a lake."}]


def _model_dir(base: Path, path: Path, config_changes: dict | None = None, files: dict[str, str] | None = None) -> Path:
    """A copy of base's tokenizer files; tokenizer_config.json updated (None removes a key),
    files written beside (relative paths)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(base / name, path / name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    for key, value in (config_changes or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def _pair(model_dir: Path) -> tuple[ModelTokenizer, transformers.PreTrainedTokenizerBase]:
    return ModelTokenizer.from_dir(model_dir, template_timeout_s=5.0), transformers.AutoTokenizer.from_pretrained(
        str(model_dir))


def _assert_same(ours: ModelTokenizer, hf, messages: list[dict], tools=None, documents=None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False, chat_template=None,
                 **template_kwargs) -> str:
    """Our text and token ids equal transformers'; returns the text."""
    text = ours.render_chat(Conversation(messages, tools, documents, add_generation_prompt, continue_final_message,
                                         chat_template, template_kwargs))
    arguments = dict(tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                     continue_final_message=continue_final_message, chat_template=chat_template, **template_kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **arguments)
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **arguments)
    assert ours.encode(text, add_special_tokens=False) == ids
    return text


@pytest.fixture(scope="module")
def template_dir(model_dir, tmp_path_factory):
    """template_dir(template or None, **tokenizer_config changes) -> a model directory."""
    root = tmp_path_factory.mktemp("templates")
    made: dict[str, Path] = {}

    def make(template, **config_changes) -> Path:
        key = json.dumps([template, config_changes], sort_keys=True)
        if key not in made:
            made[key] = _model_dir(model_dir, root / str(len(made)), {"chat_template": template, **config_changes})
        return made[key]

    return make


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(template_dir, messages, add_generation_prompt):
    ours, hf = _pair(template_dir(SMOLLM2_TEMPLATE))
    _assert_same(ours, hf, messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [LOOPS_TEMPLATE, STRFTIME_TEMPLATE, JSON_TEMPLATE, GENERATION_TEMPLATE],
                         ids=["loops", "strftime", "tojson", "generation"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_own_templates_match_transformers(template_dir, template, messages):
    ours, hf = _pair(template_dir(template))
    for add_generation_prompt in (True, False):
        _assert_same(ours, hf, messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("messages", TOOL_CONVERSATIONS)
def test_tools_and_tool_calls_match_transformers(template_dir, messages):
    ours, hf = _pair(template_dir(TOOLS_TEMPLATE))
    text = _assert_same(ours, hf, messages, tools=TOOLS)
    assert '"name": "get_weather"' in text and "\u00b0C" in text  # tojson keeps non-ASCII
    _assert_same(ours, hf, messages)  # no tools: the template leaves the tool block out


@pytest.mark.parametrize("messages", CONVERSATIONS[:3])
def test_documents_match_transformers(template_dir, messages):
    ours, hf = _pair(template_dir(DOCUMENTS_TEMPLATE))
    assert "Z\u00fcrich lies" in _assert_same(ours, hf, messages, documents=DOCUMENTS)
    _assert_same(ours, hf, messages, documents=[])
    _assert_same(ours, hf, messages)


def test_reasoning_and_template_kwargs_match_transformers(template_dir):
    ours, hf = _pair(template_dir(THINKING_TEMPLATE))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "easy"},
                {"role": "user", "content": "3+3?"}]
    text = _assert_same(ours, hf, messages, enable_thinking=False)
    assert "<think>easy</think>" in text and "<think>\n\n</think>" in text  # reasoning aliased to reasoning_content
    _assert_same(ours, hf, messages, enable_thinking=True)
    _assert_same(ours, hf, messages)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_raise_exception_matches_transformers_both_ways(template_dir, messages):
    ours, hf = _pair(template_dir(ALTERNATING_TEMPLATE))
    if all((m["role"] == "user") == (i % 2 == 0) for i, m in enumerate(messages)):
        _assert_same(ours, hf, messages)
        return
    with pytest.raises(jinja2.TemplateError, match="must alternate") as hf_error:
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as our_error:
        ours.render_chat(Conversation(messages))
    assert str(hf_error.value) in str(our_error.value)


@pytest.mark.parametrize("messages", CONTINUED)
@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, LOOPS_TEMPLATE, TOOLS_TEMPLATE], ids=["smollm2", "loops",
                                                                                            "tools"])
def test_continue_final_message_matches_transformers(template_dir, messages, template):
    ours, hf = _pair(template_dir(template))
    text = _assert_same(ours, hf, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.rstrip().endswith(messages[-1]["content"].rstrip())


def test_continue_final_message_errors_as_transformers(template_dir):
    ours, hf = _pair(template_dir(STRFTIME_TEMPLATE.replace("message.content", "message['text']")))
    cases = [
        (CONTINUED[0], dict(add_generation_prompt=True), "not compatible"),
        (CONTINUED[0], dict(add_generation_prompt=False), "content"),  # the template never reads "content"
        ([{"role": "user", "content": None, "text": "x"}], dict(add_generation_prompt=False), "no \"content\""),
    ]
    for messages, flags, words in cases:
        with pytest.raises(ValueError, match=words):
            hf.apply_chat_template(messages, tokenize=False, continue_final_message=True, **flags)
        with pytest.raises(ChatTemplateError, match=words):
            ours.render_chat(Conversation(messages, continue_final_message=True, **flags))


def test_special_tokens_reach_the_template_as_transformers_passes_them(template_dir):
    changes = {"unk_token": "<|endoftext|>", "pad_token": {"__type": "AddedToken", "content": "<|im_end|>"},
               "image_token": "<|im_start|>", "extra_special_tokens": {"audio_token": "<|endoftext|>"},
               "add_bos_token": False}
    ours, hf = _pair(template_dir(SPECIAL_TOKENS_TEMPLATE, **changes))
    text = _assert_same(ours, hf, CONVERSATIONS[0])
    assert text.startswith("<|endoftext|>|<|im_end|>|<|endoftext|>|<|im_end|>||<|im_start|>|<|endoftext|>|False")


def test_undefined_variables_behave_as_in_transformers(template_dir):
    ours, hf = _pair(template_dir("{{ nothing }}|{{ nothing is defined }}|{{ messages[0].nothing }}|"
                                  "{{ (nothing or 'fallback') }}"))
    assert _assert_same(ours, hf, CONVERSATIONS[0]) == "|False||fallback"
    ours, hf = _pair(template_dir("{{ nothing.deeper }}"))
    with pytest.raises(jinja2.UndefinedError):
        hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        ours.render_chat(Conversation(CONVERSATIONS[0]))


NAMED = [{"name": "default", "template": SMOLLM2_TEMPLATE}, {"name": "tool_use", "template": TOOLS_TEMPLATE},
         {"name": "rag", "template": DOCUMENTS_TEMPLATE}]


@pytest.mark.parametrize("messages", TOOL_CONVERSATIONS[:2])
def test_named_templates_are_chosen_as_transformers_chooses(template_dir, messages):
    ours, hf = _pair(template_dir(NAMED))
    assert _assert_same(ours, hf, messages[:1]).startswith("<|im_start|>system\nYou are a helpful AI")  # default
    assert _assert_same(ours, hf, messages, tools=TOOLS).startswith("<|im_start|>system\nYou may call")  # tool_use
    _assert_same(ours, hf, messages[:1], documents=DOCUMENTS, chat_template="rag")
    _assert_same(ours, hf, messages[:1], tools=[])  # tools given, even empty: tool_use


def test_several_templates_without_a_default_fail_as_in_transformers(model_dir, tmp_path):
    files = {"additional_chat_templates/tool_use.jinja": TOOLS_TEMPLATE, "additional_chat_templates/rag.jinja":
             DOCUMENTS_TEMPLATE}
    ours, hf = _pair(_model_dir(model_dir, tmp_path / "m", {"chat_template": SMOLLM2_TEMPLATE}, files))
    _assert_same(ours, hf, CONVERSATIONS[1], tools=TOOLS)  # the directory's templates replace the config's
    with pytest.raises(ValueError, match="no default"):
        hf.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    with pytest.raises(ChatTemplateError, match="no default"):
        ours.render_chat(Conversation(CONVERSATIONS[1]))


@pytest.mark.parametrize("template", [LOOPS_TEMPLATE, NAMED], ids=["one", "named"])
def test_checkpoint_saved_by_transformers_5_renders_the_same(model_dir, tmp_path, template):
    source = _model_dir(model_dir, tmp_path / "source", {"chat_template": template})
    transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(tmp_path / "saved"))
    saved = tmp_path / "saved"
    assert (saved / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    for name in ("config.json", "generation_config.json"):
        shutil.copy(model_dir / name, saved / name)
    ours, hf = _pair(saved)
    for messages in CONVERSATIONS:
        _assert_same(ours, hf, messages)
    for messages in TOOL_CONVERSATIONS:
        _assert_same(ours, hf, messages, tools=TOOLS, add_generation_prompt=False)


def test_chat_template_jinja_wins_over_the_config_as_in_transformers(model_dir, tmp_path):
    path = _model_dir(model_dir, tmp_path / "m", {"chat_template": LOOPS_TEMPLATE},
                      {"chat_template.jinja": SMOLLM2_TEMPLATE})
    ours, hf = _pair(path)
    assert _assert_same(ours, hf, CONVERSATIONS[0]).startswith("<|im_start|>system")


def test_no_chat_template_is_a_clear_error(template_dir):
    ours = ModelTokenizer.from_dir(template_dir(None), template_timeout_s=1.0)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.render_chat(Conversation(CONVERSATIONS[0]))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_llama_style_tokenizer_gets_one_bos_in_chat_and_one_in_text(llama_model_dir, messages):
    ours, hf = _pair(llama_model_dir)
    text = _assert_same(ours, hf, messages)
    bos = hf.bos_token_id
    assert ours.encode(text, add_special_tokens=False).count(bos) == 1
    prompt = messages[-1]["content"] or "x"
    assert ours.encode(prompt) == hf(prompt)["input_ids"] == hf.encode(prompt)
    assert ours.encode(prompt)[0] == bos and ours.encode(prompt, add_special_tokens=False) == hf(
        prompt, add_special_tokens=False)["input_ids"]


def test_decode_matches_transformers(llama_model_dir, model_dir):
    for path in (llama_model_dir, model_dir):
        ours, hf = _pair(path)
        ids = ours.encode("caf\u00e9 \U0001f680 the quick brown fox <|im_end|> \u4e2d")
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.token_pieces(ids) == hf.convert_ids_to_tokens(ids)


def test_real_smollm2_checkpoint_matches_transformers():
    from tests.pdserve.real_model import cached_smollm2

    ours, hf = _pair(cached_smollm2())  # made once per library versions, shared with the e2e tests
    assert ours.templates.sources == SMOLLM2_TEMPLATE
    for messages in CONVERSATIONS + CONTINUED:
        _assert_same(ours, hf, messages)
        _assert_same(ours, hf, messages, add_generation_prompt=False, continue_final_message=True)
        text = messages[-1]["content"] or "x"
        assert ours.encode(text) == hf(text)["input_ids"]
