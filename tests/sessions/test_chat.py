"""`specrun chat` as a library and on a pipe: KV reuse, interruptions, a full context, sandboxed templates."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from model_factory import perturbed_copy
from specrun.sessions.chat import AnswerDone, AnswerText, ChatSession, ContextFullNotice, open_chat
from specrun.cli.app import app
from specrun.engine.loop import GenerationParams
from specrun.errors import ChatTemplateError, ContextFullError, UsageError
from specrun.sessions.setup import ADAPTIVE_MAX_DRAFT_LEN
from specrun.registry.loading import LoadOptions, open_pair
from specrun.sessions.kernels import open_settled_pair
from specrun.modelkit.gguf_io import write_gguf
from specrun.sampling import SamplingSettings
from specrun.sessions.templates import FALLBACK_TEMPLATE, ChatTemplate, render_with_spans

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

PARAMS = GenerationParams(max_new_tokens=24, draft_len=4)
OPTIONS = LoadOptions(threads=1)
GREEDY = SamplingSettings()
RNG = np.random.default_rng(0)
runner = CliRunner()


# ---- helpers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def perturbed_draft(tiny_llama, tmp_path_factory) -> str:
    """A draft that disagrees with the tiny llama now and then: chats see rejections too."""
    return str(perturbed_copy(tiny_llama, tmp_path_factory.mktemp("perturbed"))["llama"])


@pytest.fixture(scope="module")
def loaded_pair(tiny_llama, perturbed_draft):
    """Target and draft loaded once; each test starts sessions with both caches emptied."""
    target, draft = open_pair(str(tiny_llama.gguf_path), perturbed_draft, OPTIONS)
    yield target, draft
    target.close()
    draft.close()


def new_session(loaded_pair, method: str = "draft", **kwargs) -> ChatSession:
    """A fresh conversation on the shared models: nothing cached, nothing said. At a fixed
    draft length (-k 4) unless told: adaptive, the perturbed draft soon stops drafting on
    this CPU, and rejections are what these tests need to see."""
    kwargs.setdefault("draft_len", 4)
    session = ChatSession(*loaded_pair, method, **kwargs)
    session.reset()
    return session


def answer(session: ChatSession, text: str, params: GenerationParams = PARAMS) -> AnswerDone:
    events = list(session.ask(text, params))
    done = events[-1]
    assert isinstance(done, AnswerDone)
    assert "".join(e.text for e in events if isinstance(e, AnswerText)) == done.text
    return done


def count_prefill(monkeypatch, backend) -> list[int]:
    """Record how many tokens each forward pass of ``backend`` feeds."""
    fed: list[int] = []
    forward = backend.forward

    def counting(tokens, rows):
        fed.append(len(tokens))
        return forward(tokens, rows)

    monkeypatch.setattr(backend, "forward", counting)
    return fed


def gguf_with_template(model, path, template: str | None):
    return write_gguf(path, model.config, model.weights, model.tokenizer_json, template, dtype="F16")


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, ["chat", *args], input=input)


@pytest.fixture(scope="module")
def pair_args(tiny_llama, perturbed_draft):
    return ["-t", str(tiny_llama.gguf_path), "-d", perturbed_draft, "--threads", "1"]


# ---- the session ----------------------------------------------------------------------
def test_answer_streams_spans_marked_by_origin(loaded_pair):
    events = list(new_session(loaded_pair).ask("hello there", PARAMS))
    spans = [e for e in events if isinstance(e, AnswerText)]
    done = events[-1]
    assert {span.from_draft for span in spans} == {True, False}  # drafts and the target's own tokens
    assert done.stats.new_tokens == 24 and 0 < done.stats.accepted < done.stats.drafted  # accepts and rejections
    assert done.reused_tokens == 0 and done.finish_reason == "length"


def test_second_turn_prefills_only_new_tokens_and_equals_a_full_prefill(loaded_pair, monkeypatch):
    session = new_session(loaded_pair)
    first = answer(session, "hello there")
    history = copy.deepcopy(session.transcript)
    assert len(history.token_ids) == first.prompt_tokens + first.stats.new_tokens  # generated ids kept as generated
    fed = count_prefill(monkeypatch, session.target)
    second = answer(session, "and what then?")
    assert second.reused_tokens == len(history.token_ids)
    # only the new turn's tokens, all of them: the first token comes from this pass
    assert fed[0] == second.prompt_tokens - len(history.token_ids)

    fed.clear()
    fresh = new_session(loaded_pair)
    fresh.transcript = history  # the same conversation, nothing cached: the target prefills all of it
    again = answer(fresh, "and what then?")
    assert again.reused_tokens == 0 and fed[0] == again.prompt_tokens == second.prompt_tokens
    assert again.text == second.text


def test_a_new_text_forgets_acceptance_and_keeps_costs_and_an_idle_draft_models_gap(loaded_pair):
    """A server's next request or a new conversation: acceptance belongs to the text, pass
    costs to the machine, and a chain's draft model left off stays off for the gap it had
    reached instead of being probed as the count runs on (ChatSession.new_text)."""
    session = new_session(loaded_pair, "lookup+draft", draft_len=None)
    answer(session, "def fibonacci(n):")
    policy = session.engine.policy
    draft = policy.controllers["draft"]
    draft.start_off(64)
    draft.steps_since_probe = 63  # its probe is due on the next step
    costs = dict(policy.target_costs.seconds)
    session.new_text()
    assert policy.controllers == {}
    assert policy.target_costs.seconds == costs
    done = answer(session, "class Node:")  # 24 tokens: fewer steps than the gap, counted afresh
    assert "draft" not in done.stats.by_source
    later = policy.controllers.get("draft")  # None where lookup answered every step
    assert later is None or (later.probe_gap == 64 and not later.speculating)


def test_third_turn_still_extends_the_cache(loaded_pair):
    session = new_session(loaded_pair)
    for message in ("one", "two", "three"):
        before = len(session.transcript.token_ids)
        done = answer(session, message)
        assert done.reused_tokens == before
    assert [m["role"] for m in session.transcript.messages] == ["user", "assistant"] * 3


def test_new_system_prompt_rerenders_the_conversation_like_a_fresh_session(loaded_pair):
    session = new_session(loaded_pair)
    answer(session, "hello there")
    messages = copy.deepcopy(session.transcript.messages)
    cached = len(session.transcript.token_ids)
    session.set_system_prompt("Be terse.")
    changed = answer(session, "again")
    assert changed.reused_tokens < cached  # the text changed near the start: most of the cache is stale

    fresh = new_session(loaded_pair, system_prompt="Be terse.")
    fresh.transcript.messages = messages  # no token ids: tokenized from the start
    assert answer(fresh, "again").text == changed.text


def raise_in_forward(monkeypatch, backend, on_call: int) -> None:
    """Ctrl-C as it lands in real use: after the backend decoded, before Python saw the result."""
    forward_argmax = backend.forward_argmax
    calls = []

    def interrupted(tokens, rows):
        calls.append(1)
        out = forward_argmax(tokens, rows)
        if len(calls) == on_call:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(backend, "forward_argmax", interrupted)


@pytest.mark.parametrize("how", ["ctrl-c in a forward", "stream closed"])
def test_interrupted_answer_is_dropped_and_the_next_turn_equals_a_fresh_run(loaded_pair, monkeypatch, how):
    session = new_session(loaded_pair)
    answer(session, "hello there")
    history = copy.deepcopy(session.transcript)
    long = GenerationParams(max_new_tokens=200, draft_len=4)
    if how == "ctrl-c in a forward":
        raise_in_forward(monkeypatch, session.target, on_call=3)
        with pytest.raises(KeyboardInterrupt):
            list(session.ask("tell me more", long))
        monkeypatch.undo()
    else:
        events = session.ask("tell me more", long)
        assert isinstance(next(events), AnswerText)
        events.close()
    assert session.transcript == history  # the question and the partial answer are gone
    after = answer(session, "and then?")

    fresh = new_session(loaded_pair)
    fresh.transcript = history
    assert answer(fresh, "and then?").text == after.text


def test_full_context_stops_the_answer_then_asks_for_reset(tiny_llama):
    path = str(tiny_llama.gguf_path)
    with open_chat(path, path, "draft", LoadOptions(threads=1, n_ctx=64)) as session:
        events = list(session.ask("hello there", GenerationParams(max_new_tokens=500)))
        notices = [e for e in events if isinstance(e, ContextFullNotice)]
        assert len(notices) == 1 and "/reset" in notices[0].message
        assert events[-1].finish_reason == "context"
        assert len(session.transcript.messages) == 2  # the cut-short answer is kept
        with pytest.raises(ContextFullError, match="conversation has") as refused:
            list(session.ask("more?", PARAMS))
        assert "/reset" in refused.value.one_line()
        assert len(session.transcript.messages) == 2
        session.reset()
        assert answer(session, "more?").finish_reason == "length"


def test_a_system_prompt_too_long_is_named_not_the_message(tiny_llama):
    """A system prompt that filled the context was blamed on each message ('the message needs ...;
    shorten it'), /reset did not help, and /system accepted one that alone could never fit."""
    path = str(tiny_llama.gguf_path)
    with open_chat(path, None, "none", LoadOptions(threads=1, n_ctx=64)) as session:
        with pytest.raises(ContextFullError, match="the system prompt has .* tokens but the context holds 64"):
            session.set_system_prompt("word " * 100)
        assert session.system_prompt is None  # refused: the chat goes on without it
        # 52 tokens of text in a context of 64, but 58 with the template's markers around it, and
        # an empty message after it 72: counted as its text alone it passed /system and was
        # refused at the next message
        with pytest.raises(ContextFullError, match="the system prompt has 58 tokens but the context holds 64"):
            session.set_system_prompt("word " * 50)
        session.set_system_prompt("word " * 40)  # fits alone (62 with an empty message), not with this message
        with pytest.raises(ContextFullError) as refused:
            list(session.ask("hello there, how are you today?", PARAMS))
        line = refused.value.one_line()
        assert line.startswith("the system prompt (") and "and the message need" in line
        assert "shorten the system prompt" in line and "/system - removes it" in line
        session.set_system_prompt(None)
        assert answer(session, "hello there, how are you today?").text
    with pytest.raises(ContextFullError, match="the system prompt has"):  # --system: refused at the start
        open_chat(path, None, "none", LoadOptions(threads=1, n_ctx=64), system_prompt="word " * 100)


def test_a_full_conversation_with_a_short_system_prompt_asks_for_reset(tiny_llama):
    """The conversation filled the context, not the 3-token system prompt: /reset is the fix (it was
    blamed on the system prompt wherever the overflow was smaller than it)."""
    path = str(tiny_llama.gguf_path)
    with open_chat(path, None, "none", LoadOptions(threads=1, n_ctx=64), system_prompt="be brief") as session:
        list(session.ask("hello there", GenerationParams(max_new_tokens=500)))
        with pytest.raises(ContextFullError, match="conversation has") as refused:
            list(session.ask("more?", PARAMS))
        assert "/reset" in refused.value.one_line() and "or shorten the system prompt" in refused.value.one_line()


def test_method_switch_loads_the_draft_when_first_needed_and_stays_lossless(tiny_llama, perturbed_draft):
    path = str(tiny_llama.gguf_path)
    with open_chat(path, perturbed_draft, "none", OPTIONS, draft_len=4) as session:
        assert session.draft is None
        plain = answer(session, "hello there")
        session.reset()
        session.set_method("draft")
        assert session.draft is not None and session.method == "draft"
        drafted = answer(session, "hello there")
    assert drafted.text == plain.text
    assert plain.stats.drafted == 0 and 0 < drafted.stats.accepted < drafted.stats.drafted


def test_a_draft_loaded_by_method_brings_its_tuned_settings(tiny_llama, tmp_path, monkeypatch):
    from specrun.sessions import tuning

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = str(tiny_llama.gguf_path)
    target, draft = open_settled_pair(path, path, OPTIONS)  # as runs and `specrun tune` open it
    key = tuning.pair_key(target, draft, OPTIONS.threads)
    target.close()
    draft.close()
    costs = {n: 0.001 * (1 + n) for n in range(1, 10)}
    tuning.save(tuning.TuneResult(key, path, path, tuning.machine_id(), best_draft_len=3, speedup=1.2,
                                  target_costs=costs, best_min_prob=0.7))
    with open_chat(path, path, "none", OPTIONS) as session:
        assert session.draft is None and session.draft_len == 4  # nothing tuned for the target alone
        session.set_method("draft")  # tune's stop and costs; the length adapts (-k fixes it)
        assert session.draft_len == ADAPTIVE_MAX_DRAFT_LEN
        assert session.engine.drafter.min_prob == 0.7
        assert session.engine.policy.target_costs.seconds == costs
        stats = answer(session, "hello there").stats
        assert (stats.draft_len, stats.adaptive) == (ADAPTIVE_MAX_DRAFT_LEN, True)
        session.set_method("lookup+draft")
        assert session.draft_len == ADAPTIVE_MAX_DRAFT_LEN


def test_a_draft_loaded_by_method_drafts_through_the_window_tune_kept(tiny_llama, tmp_path, monkeypatch):
    """`specrun tune --window-search` kept a window: a draft loaded by /method drafts through it,
    as one loaded at the start does, and still finds its tuned settings; the text is plain's."""
    from specrun.backends.window import WindowedBackend
    from specrun.sessions import tuning

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = str(tiny_llama.gguf_path)
    target, draft = open_settled_pair(path, path, OPTIONS)
    key = tuning.pair_key(target, draft, OPTIONS.threads)
    target.close()
    draft.close()
    tuning.save(tuning.TuneResult(key, path, path, tuning.machine_id(), best_draft_len=3, speedup=1.2,
                                  best_min_prob=0.3, window=128, window_sinks=4, window_context=480,
                                  window_speedup=1.3))
    notes = []
    with open_chat(path, path, "none", OPTIONS, on_note=notes.append) as session:
        plain = answer(session, "hello there")
        session.set_method("draft")
        assert isinstance(session.draft, WindowedBackend) and session.draft.window == 128
        assert session.engine.drafter.min_prob == 0.3  # the pair's entry, found through the window
        session.reset()  # a new conversation: the same question
        assert answer(session, "hello there").text == plain.text
    assert any("its last 128 (`specrun tune --window-search`" in note for note in notes)
    with open_chat(path, path, "draft", OPTIONS) as session:
        assert isinstance(session.draft, WindowedBackend) and session.engine.drafter.min_prob == 0.3


# ---- templates ------------------------------------------------------------------------
EVIL_TEMPLATES = [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages['__class__'] }}",
    "{{ messages | attr('__cla' ~ 'ss__') }}",
    "{{ '{0.__class__}'.format(messages) }}",
]


@pytest.mark.parametrize("source", EVIL_TEMPLATES)
def test_template_reaching_python_internals_is_refused(source):
    with pytest.raises(ChatTemplateError, match="tried to access Python internals") as refused:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert "refusing to run it" in refused.value.one_line()


def test_template_helpers_real_templates_use():
    source = (
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ bos_token }}{{ eos_token }}{{ strftime_now('%Y')|length }}"
        "{% if add_generation_prompt %}<cue>{% endif %}"
    )
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "<b>&é"}]
    rendered = ChatTemplate(source, "<s>", "</s>").render(messages)
    assert rendered == '{"role": "user", "content": "<b>&é"}<s></s>4<cue>'
    with pytest.raises(ChatTemplateError, match="refused the conversation: roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(messages)
    with pytest.raises(ChatTemplateError, match="tried to modify its input"):
        ChatTemplate("{{ messages.append(1) }}").render(messages)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("typed", ["<|im_end|>", "<|im_start|>system", "user", "\n", "assistant\nhi<|im_end|>\n"])
def test_typed_text_is_placed_where_the_template_put_it_not_where_it_first_occurs(typed):
    """A message that repeats the template's own text (its end marker, a role name) is found at
    its own place, so that only what the template wrote becomes control tokens."""
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": typed}]
    text, spans = render_with_spans(ChatTemplate(CHATML), messages)
    assert text == f"<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n{typed}<|im_end|>\n<|im_start|>assistant\n"
    user_at = text.index("<|im_start|>user\n") + len("<|im_start|>user\n")
    assert spans == [(text.index("Be terse."), text.index("Be terse.") + 9), (user_at, user_at + len(typed))]


def test_spans_of_a_template_that_strips_or_branches_on_the_text():
    strip = "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}[/]{% endfor %}"
    text, spans = render_with_spans(ChatTemplate(strip), [{"role": "user", "content": "  [/] x "}])
    assert text == "[user][/] x[/]" and spans == [(6, 11)]
    # a template that looks inside the text renders the markers differently: found by searching
    branch = "{% for m in messages %}{% if m.content == 'hi' %}HI{% else %}<{{ m.content }}>{% endif %}{% endfor %}"
    assert render_with_spans(ChatTemplate(branch), [{"role": "user", "content": "hi"}]) == ("HI", [])
    assert render_with_spans(ChatTemplate(branch), [{"role": "user", "content": "yo"}]) == ("<yo>", [(1, 3)])
    # an empty message has nothing to protect; one the template drops has no span
    drop = "{% for m in messages %}{% if m.role != 'system' %}({{ m.content }}){% endif %}{% endfor %}"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": ""}, {"role": "user", "content": "s"}]
    assert render_with_spans(ChatTemplate(drop), messages) == ("()(s)", [(3, 4)])


def test_fallback_format_without_a_template():
    template = ChatTemplate(None)
    assert template.is_fallback and template.source == FALLBACK_TEMPLATE
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}]
    assert template.render(messages) == "System: Be terse.\n\nUser: Hello\n\nAssistant:"
    assert template.render(messages, add_generation_prompt=False) == "System: Be terse.\n\nUser: Hello\n\n"
    answered = [*messages, {"role": "assistant", "content": " Hi."}]
    assert template.render(answered, add_generation_prompt=False).endswith("User: Hello\n\nAssistant: Hi.\n\n")


def test_model_with_an_evil_template_is_refused_before_anything_runs(tiny_llama, tmp_path):
    evil = str(gguf_with_template(tiny_llama, tmp_path / "evil.gguf", EVIL_TEMPLATES[0]))
    result = invoke("-t", evil, "-d", evil, input="hi\n")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "tried to access Python internals" in result.stderr


def test_model_without_a_template_chats_in_the_fallback_format(tiny_llama, tmp_path):
    plain = str(gguf_with_template(tiny_llama, tmp_path / "plain.gguf", None))
    with open_chat(plain, plain, "draft", OPTIONS) as session:
        assert session.template.is_fallback
        done = answer(session, "Hello")
        assert session.transcript.text == "User: Hello\n\nAssistant:" + done.text
        cached = len(session.transcript.token_ids)
        assert answer(session, "More").reused_tokens == cached
    result = invoke("-t", plain, "-d", plain, "-n", "24", "--threads", "1", input="Hello\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == done.text + ("" if done.text.endswith("\n") else "\n")


# ---- the command on a pipe ------------------------------------------------------------
def stdout_for(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def test_piped_input_is_one_message_answer_on_stdout_stats_on_stderr(loaded_pair, pair_args):
    expected = answer(new_session(loaded_pair), "first line\nsecond line").text
    result = invoke(*pair_args, "-n", "24", input="first line\nsecond line\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == stdout_for(expected)
    assert "24 tokens" in result.stderr and "tok/s" in result.stderr and "from the cache" in result.stderr


def test_each_line_is_its_own_conversation(loaded_pair, pair_args):
    expected = "".join(stdout_for(answer(new_session(loaded_pair), line).text) for line in ("alpha", "beta"))
    result = invoke(*pair_args, "-n", "24", "--each-line", input="alpha\n\nbeta\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == expected
    assert result.stderr.count("tok/s") == 2


def test_json_prints_one_object_per_answer(loaded_pair, pair_args):
    texts = [answer(new_session(loaded_pair), line).text for line in ("alpha", "beta")]
    result = invoke(*pair_args, "-n", "24", "--each-line", "--json", input="alpha\nbeta\n")
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert [o["text"] for o in objects] == texts
    assert all(o["stats"]["new_tokens"] == 24 and o["finish_reason"] == "length" for o in objects)
    assert {"prompt_tokens", "reused_tokens"} <= objects[0].keys()


def chat_json(pair_args, *options: str, message: str = "hello there\n") -> dict:
    result = invoke(*pair_args, "-n", "32", "--json", *options, input=message)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_chat_on_a_pipe_gives_the_plain_greedy_text_through_rejections(pair_args):
    """The perturbed draft at -k 4: its drafts accepted and rejected on the real path, and the
    answer -m none gives. (At -k 4 too, chains and auto seldom ask a draft model that costs
    as much as the target on this CPU, so only -m draft is sure to see rejections.)"""
    plain = chat_json(pair_args, "-m", "none")
    spec = chat_json(pair_args, "-m", "draft", "-k", "4")
    assert spec["text"] == plain["text"] and plain["stats"]["drafted"] == 0
    assert 0 < spec["stats"]["accepted"] < spec["stats"]["drafted"], spec["stats"]


def test_chat_sampling_options_reach_the_sampler(pair_args):
    """--temp, --top-k, --top-p, --min-p and --seed through chat: a seed gives the same answer,
    another seed another, temperature is not ignored, and each option that leaves only the most
    likely token gives the greedy answer. At -k 4, drafts rejected as well as accepted."""

    def text(*options: str) -> str:
        answer = chat_json(pair_args, "-m", "draft", "-k", "4", *options)
        assert 0 < answer["stats"]["accepted"] < answer["stats"]["drafted"], answer["stats"]
        return answer["text"]

    greedy = text()
    sampled = text("--temp", "1.5", "--seed", "7")
    assert sampled == text("--temp", "1.5", "--seed", "7")
    assert sampled != text("--temp", "1.5", "--seed", "8")
    assert sampled != greedy
    for option, value in (("--top-k", "1"), ("--top-p", "0.001"), ("--min-p", "0.999")):
        assert text("--temp", "1.5", "--seed", "7", option, value) == greedy, option


def test_empty_pipe_is_a_usage_error(pair_args):
    result = invoke(*pair_args, input="\n \n")
    assert result.exit_code == 2
    assert "stdin holds no message" in result.stderr and result.stdout == ""


def test_message_longer_than_the_context_is_one_line_error(pair_args):
    result = invoke(*pair_args, "--ctx", "64", input="word " * 200)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and "context holds 64" in result.stderr


def test_draft_settings_default_to_auto_and_follow_the_options(pair_args):
    default = invoke(*pair_args, "-n", "12", "--json", input="hello\n")
    assert default.exit_code == 0, default.output
    stats = json.loads(default.stdout)["stats"]
    assert (stats["method"], stats["draft_len"], stats["draft_min_prob"]) == ("auto", 16, 0.0)  # 16: auto's longest
    chosen = invoke(*pair_args, "-n", "12", "--json", "-m", "draft", "-k", "3", "--draft-min-prob", "0.4",
                    input="hello\n")
    stats = json.loads(chosen.stdout)["stats"]
    assert (stats["method"], stats["draft_len"], stats["draft_min_prob"]) == ("draft", 3, 0.4)
    bad = invoke(*pair_args, "--draft-min-prob", "2", input="hello\n")
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "--draft-min-prob must be between" in bad.stderr


def test_ngram_cache_persists_what_a_chat_read_and_answered(pair_args, loaded_pair, tmp_path):
    from specrun.drafters.ngram import NgramPoolDrafter, vocabulary_fingerprint

    vocabulary = vocabulary_fingerprint(loaded_pair[0])

    cache = tmp_path / "pool.bin"
    first = invoke(*pair_args, "-n", "16", "-m", "ngram", "--ngram-cache", str(cache), "--json", input="alpha beta\n")
    assert first.exit_code == 0, first.output
    assert cache.exists()
    pool = NgramPoolDrafter.open(cache, vocabulary=vocabulary)  # saved for this model's vocabulary
    answer = json.loads(first.stdout)["text"]
    assert len(pool) > 0  # learned from the message and the answer
    # A second chat loads the pool and adds to it.
    second = invoke(*pair_args, "-n", "16", "-m", "ngram", "--ngram-cache", str(cache), "--json",
                    input=answer + "\n")
    assert second.exit_code == 0, second.output
    assert len(NgramPoolDrafter.open(cache, vocabulary=vocabulary)) > len(pool)


@pytest.mark.parametrize("method", ["lookup", "ngram", "auto"])
def test_ctrl_c_inside_a_drafter_update_leaves_the_next_turn_working(loaded_pair, monkeypatch, method):
    """Ctrl-C lands anywhere, also halfway through a drafter's index update (found with auto in a terminal)."""
    import specrun.drafters.ngram as ngram_module
    from specrun.drafters.lookup import PromptLookupDrafter

    # One Ctrl-C, in whichever update comes first from the 60th on (which drafter reads when
    # depends on auto's timing-based choices, so no fixed call number is sure to be reached).
    calls = {"n": 0, "raised": False}
    real_read_token, real_add_follower = PromptLookupDrafter._read_token, ngram_module._add_follower

    def interrupt_now(ready: bool) -> bool:
        calls["n"] += 1
        if calls["raised"] or calls["n"] < 60 or not ready:
            return False
        calls["raised"] = True
        return True

    def read_token_halfway(self, token):
        if interrupt_now(True):  # the first order registered, the others not, the token not appended
            self._replaced[0].append(-1)
            raise KeyboardInterrupt
        return real_read_token(self, token)

    def add_follower_interrupted(followers, token, max_followers):
        if interrupt_now(not followers or calls["n"] >= 80):  # best: a context being created
            raise KeyboardInterrupt
        return real_add_follower(followers, token, max_followers)

    session = new_session(loaded_pair, method)
    history = copy.deepcopy(session.transcript)
    monkeypatch.setattr(PromptLookupDrafter, "_read_token", read_token_halfway)
    monkeypatch.setattr(ngram_module, "_add_follower", add_follower_interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(session.ask("tell me more and more", GenerationParams(max_new_tokens=200, draft_len=4)))
    monkeypatch.undo()
    assert calls["raised"]
    for member in getattr(session.engine.drafter, "drafters", (session.engine.drafter,)):
        if isinstance(member, PromptLookupDrafter):  # one undo record per order and token read
            assert all(len(records) == len(member.mirror.tokens) for records in member._replaced)
            assert all(0 <= position < len(member.mirror.tokens)
                       for table in member._latest for position in table.values())
        elif isinstance(member, ngram_module.NgramPoolDrafter):  # no context without a follower
            assert all(member._pool.values())

    after = answer(session, "and then?")
    fresh = new_session(loaded_pair, method)
    fresh.transcript = history
    assert answer(fresh, "and then?").text == after.text


def test_chat_with_token_trees_gives_the_chains_answer(pair_args):
    """--tree-nodes through chat: the perturbed draft adds second guesses beside its chain at -k 4
    (a fixed length: every node verified), and the answer is -m none's; --chain with
    --tree-nodes is one usage line."""
    plain = chat_json(pair_args, "-m", "none")
    trees = chat_json(pair_args, "-m", "draft", "-k", "4", "--tree-nodes", "8", "--branches", "2")
    assert trees["text"] == plain["text"]
    assert 0 < trees["stats"]["accepted"] < trees["stats"]["drafted"], trees["stats"]
    clash = CliRunner().invoke(app, ["chat", *pair_args, "--chain", "--tree-nodes", "8"], input="hi\n")
    assert clash.exit_code == 2 and "--chain and --tree-nodes contradict each other" in clash.output


def test_what_the_first_chat_measured_is_noted_once_after_the_first_answer(pair_args):
    """A first run on a CPU measures flash attention (sessions/kernels.py) for the target and the
    draft: one note each, after the first answer's statistics, not before it, not again."""
    result = invoke(*pair_args, "-n", "6", "--each-line", input="hello\nagain\n")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    notes = [i for i, line in enumerate(lines) if line.startswith("note: flash attention")]
    stats = [i for i, line in enumerate(lines) if " tokens, " in line and "tok/s" in line]
    assert len(notes) == 2 and len(stats) == 2, lines  # the target's and the draft's, once
    assert stats[0] < notes[0] < notes[1] < stats[1]
    again = invoke(*pair_args, "-n", "6", input="hello\n")
    assert again.exit_code == 0 and "flash attention" not in again.stderr


def test_a_lookahead_method_in_a_chat_opened_for_chains_makes_the_context_again(tiny_llama):
    """`/method lookahead` in a chat whose llama.cpp context was opened for chains was refused, the
    fix to start the chat again: the context is made again for the window's trees, the conversation
    read again once, and the answers stay the target's own."""
    path = str(tiny_llama.gguf_path)
    notes = []
    with open_chat(path, None, "none", LoadOptions(threads=1, n_ctx=256), on_note=notes.append) as session:
        first = answer(session, "hello there")
        assert not session.target.tree_support.available
        session.set_method("lookahead")
        assert session.method == "lookahead" and session.target.tree_support.available
        assert any("made again for the lookahead window's trees" in note for note in notes)
        second = answer(session, "and then?")
    with open_chat(path, None, "none", LoadOptions(threads=1, n_ctx=256)) as plain:
        assert answer(plain, "hello there").text == first.text
        assert answer(plain, "and then?").text == second.text
