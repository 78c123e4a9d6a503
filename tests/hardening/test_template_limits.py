"""Issue 32, items 10 and 11: a chat template that would render gigabytes or run for hours is
stopped within its limits, with one line that blames the template, not the conversation."""

from __future__ import annotations

import time

import pytest

from specrun.errors import ChatTemplateError
from specrun.sessions import templates
from specrun.sessions.templates import ChatTemplate

MESSAGES = [{"role": "user", "content": "Hello"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"

HOSTILE = {
    "nested empty loops": LOOPS.replace("BODY", ""),
    "nested loops that print": LOOPS.replace("BODY", "xxxxxxxxxx"),
    "nested loops that compute": LOOPS.replace("BODY", "{% if j is divisibleby 7 %}{% endif %}"),
    "string times a huge number": "{{ 'x' * 10**10 }}",
    "list times a huge number": "{{ ([1] * 10**10) | length }}",
    "a huge power": "{{ 7 ** (10 ** 10) }}",
    "a filter told to pad a lot": "{{ 'x' | center(10**10) }}",
    "a huge %-format width": "{{ '%10000000000s' % 'x' }}",
    "a huge format width": "{{ '{:>10000000000}'.format('x') }}",
    "doubling a namespace string": (
        "{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "doubling with +": (
        "{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"
    ),
}


@pytest.mark.parametrize("source", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_templates_stop_at_the_limits(source, monkeypatch):
    monkeypatch.setattr(templates, "MAX_RENDER_SECONDS", 1.0)
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError) as caught:
        ChatTemplate(source).render(MESSAGES)
    assert time.perf_counter() - started < 10
    line = caught.value.one_line()
    assert "chat template" in line and "\n" not in line
    assert "too" in caught.value.problem  # too long, too large
    assert "conversation" not in caught.value.fix


def test_an_ordinary_template_still_renders():
    source = (
        "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] | trim }}"
        "{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
        "{{ '%5s' % 'ab' }}{{ '{:>4}'.format('c') }}{{ 'x' * 3 }}{{ 2 ** 10 }}{{ 'y' | center(5) }}"
    )
    rendered = ChatTemplate(source).render(MESSAGES + [{"role": "assistant", "content": " Hi "}])
    assert rendered == "<|user|>Hello<|assistant|>Hi<|assistant|>   ab   cxxx1024  y  "


def test_filters_that_take_the_environment_or_context_still_work():
    source = ("{{ messages | map(attribute='content') | join(',') }}|{{ 'abcdef' | truncate(5, True, '..', 0) }}|"
              "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}")
    rendered = ChatTemplate(source).render(MESSAGES + [{"role": "assistant", "content": "Hi"}])
    assert rendered == "Hello,Hi|abc..|1"


@pytest.mark.parametrize("source, said", [
    ("{{ messages[0].content | nofilter }}", "does not compile: No filter named 'nofilter'"),
    ("{% for m in messages %}", "is not valid Jinja"),
])
def test_a_template_that_does_not_compile_is_one_line_blaming_it(source, said):
    """A filter or test no environment has passes Jinja's parse and fails its compile: that was an
    internal error in every command, and `specrun serve` died as it opened."""
    with pytest.raises(ChatTemplateError) as caught:
        ChatTemplate(source)
    line = caught.value.one_line()
    assert "chat template" in line and said in line and "\n" not in line
