"""Chat templates are untrusted code: every failure is a ChatTemplateError (a 400) naming the
problem, never a crash or a hang; runaway templates stop at the deadline or the output cap,
and the thread that ran one is fine afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from proxy.errors import ChatTemplateError
from proxy.template_sandbox import MAX_RENDERED_CHARS
from proxy.templates import ChatTemplates, Conversation

TIMEOUT_S = 0.3
USER = [{"role": "user", "content": "hi"}]


def _render(source: str, messages: list[dict] | None = None, timeout_s: float = TIMEOUT_S) -> str:
    return ChatTemplates(source, timeout_s).render(Conversation(messages or USER), {"eos_token": "</s>"})


@pytest.mark.parametrize("source, words", [
    ("{% for m in messages %}{{ m.content }", "syntax error on line 1"),
    ("{{ raise_exception('no system messages, please') }}", "no system messages, please"),
    ("{{ nothing.deeper }}", "UndefinedError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages.append(1) }}", "SecurityError"),
    ("{% set ns = namespace(_hidden=1) %}", "underscore"),
    ("{% set ns = namespace(x=1) %}{% set ns.__dict__ = 2 %}", "underscore"),
    ("{{ 'x' * 1000000000 }}", "at most"),
    ("{{ [1, 2] * 999999999 }}", "at most"),
    ("{{ 10 ** 1000000000 }}", "bits"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[5] }}{{ messages[5].content + 'x' }}", "UndefinedError"),
    ("{{ 'a' + messages }}", "TypeError"),
    ("{{ messages | tojson }}{{ messages | sum }}", "TypeError"),
])
def test_template_failures_are_chat_template_errors_naming_the_problem(source, words):
    with pytest.raises(ChatTemplateError, match=words):
        _render(source)


@pytest.mark.parametrize("source, num_messages", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 1),
    # NOTE: empty loop bodies over the request's own data call no sandbox hook: only the
    # watchdog's interrupt stops them.
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}", 2000),
    ("{% macro f(n) %}{% for i in range(100) %}{{ f(n + 1) if n < 50 }}{% endfor %}{% endmacro %}{{ f(0) }}", 1),
])
def test_runaway_templates_stop_at_the_deadline(source, num_messages):
    messages = [{"role": "user", "content": "x"}] * num_messages
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="did not finish within 0.3 s"):
        _render(source, messages)
    # NOTE: each template runs for hours unbounded; the slack covers a loaded CI machine, where
    # the watchdog thread's wake-up came 0.65 s late once (a clean-clone run on 2 busy cores).
    assert time.monotonic() - started < TIMEOUT_S + 5.0


def test_output_past_the_cap_is_refused_without_waiting_for_the_deadline():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages | tojson }}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=f"^chat template output passed {MAX_RENDERED_CHARS} characters$"):
        _render(source, [{"role": "user", "content": "x" * 10_000}], timeout_s=30.0)
    assert time.monotonic() - started < 5.0


def test_a_thread_that_ran_into_the_deadline_is_fine_afterwards():
    templates = ChatTemplates("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                              TIMEOUT_S)
    quick = ChatTemplates("{% for m in messages %}{{ m.content }}{% endfor %}", TIMEOUT_S)
    with ThreadPoolExecutor(max_workers=1) as pool:
        for _ in range(3):
            with pytest.raises(ChatTemplateError):
                pool.submit(templates.render, Conversation(USER), {}).result()
            assert pool.submit(quick.render, Conversation(USER), {}).result() == "hi"
        # a render finishing right at its deadline must not leave an interrupt behind
        for _ in range(20):
            pool.submit(quick.render, Conversation(USER * 300), {}).result()
        busy = pool.submit(_spin, TIMEOUT_S * 2)
        assert busy.result() > 0


def test_a_runaway_template_does_not_hold_up_other_renders():
    slow = ChatTemplates("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 2.0)
    quick = ChatTemplates("{% for m in messages %}{{ m.content }}{% endfor %}", 2.0)
    with ThreadPoolExecutor(max_workers=4) as pool:
        stuck = pool.submit(slow.render, Conversation(USER), {})
        started = time.monotonic()
        assert [pool.submit(quick.render, Conversation(USER), {}).result() for _ in range(20)] == ["hi"] * 20
        assert time.monotonic() - started < 1.0
        with pytest.raises(ChatTemplateError, match="within 2 s"):
            stuck.result()


def test_request_templates_need_trust_unless_they_name_the_models_own():
    templates = ChatTemplates({"default": "{{ messages[0].content }}", "short": "S"}, TIMEOUT_S)
    with pytest.raises(ChatTemplateError, match="trust-request-chat-template") as error:
        templates.render(Conversation(USER, chat_template="{{ 'mine' }}"), {})
    assert error.value.param == "chat_template"
    assert templates.render(Conversation(USER, chat_template="short"), {}) == "S"
    trusting = ChatTemplates("{{ messages[0].content }}", TIMEOUT_S, is_request_template_trusted=True)
    assert trusting.render(Conversation(USER, chat_template="{{ 'mine' }}"), {}) == "mine"


def test_template_kwargs_may_not_replace_the_conversation():
    with pytest.raises(ChatTemplateError, match="messages"):
        ChatTemplates("x", TIMEOUT_S).render(Conversation(USER, template_kwargs={"messages": []}), {})


def _spin(duration_s: float) -> int:
    """Plain Python work in a pool thread: an interrupt left pending would surface here."""
    count, deadline = 0, time.monotonic() + duration_s
    while time.monotonic() < deadline:
        count += 1
    return count
